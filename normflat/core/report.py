"""Results: one :class:`LayerResult` per weight tensor, totals in a :class:`Report`.

Reports serialize to strict JSON (:meth:`Report.to_json`) in the versioned schema
:data:`SCHEMA` and load back exactly (:meth:`Report.from_json`,
:func:`load_report`); :func:`compare_reports` puts several reports side by side
per layer. The JSON format is described in ``docs/api.md`` ("Report files").
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

# MEASURES lives in a leaf module so that the figures can use it without importing
# this one; it stays importable from here.
from normflat.core.constants import MEASURES

__all__ = [
    "LayerResult", "Report", "ReportComparison", "MEASURES", "SCHEMA", "compare_reports", "load_report",
    "standard_error_of",
]

#: Name and version of the JSON format written by :meth:`Report.to_json`. The
#: version is raised whenever a reader of the previous version would misread a
#: file; a reader refuses versions newer than its own.
SCHEMA = "normflat.report/1"
_SCHEMA_RE = re.compile(r"normflat\.report/(\d+)")
_SCHEMA_VERSION = 1


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
        """JSON-ready dict in the :data:`SCHEMA` layout (strict JSON: no NaN/Infinity).

        Non-finite numbers of the numeric fields are the strings ``"inf"``,
        ``"-inf"`` and ``"nan"`` (``float()`` reads them back), so an optimum at
        infinity (``row_sigma`` of a degenerate row) stays distinguishable from NaN.
        """
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            **{m: _encode_float(getattr(self, m)) for m in MEASURES},
            "row_sigma": _encode_floats(self.row_sigma),
            "col_sigma": _encode_floats(self.col_sigma),
            "iterations": self.iterations,
            "imbalance": _encode_float(self.imbalance),
            "converged": self.converged,
            "degenerate_rows": list(self.degenerate_rows),
            "degenerate_cols": list(self.degenerate_cols),
            "clipped": self.clipped,
            "standard_error": _encode_measure_dict(self.standard_error),
            # The per-group values behind the standard errors: the report's total
            # standard error is formed from them (per-group sums over layers).
            "group_values": None if self._group_values is None else {
                m: _encode_floats(v) for m, v in self._group_values.items()},
            "details": _encode_value(self.details),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LayerResult":
        """Inverse of :meth:`to_dict` (one layer of a :data:`SCHEMA` report).

        Raises:
            ValueError: If ``data`` is not a layer of a normflat report.
        """
        return _layer_from_dict(data, tagged=True, where="layer")

    def __eq__(self, other: object) -> bool:
        # Value equality (arrays element by element, NaN equal to NaN in the same
        # place), so that a report read back from JSON compares equal to the original.
        if not isinstance(other, LayerResult):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # mutable numpy arrays inside: no value hash


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
        """JSON-ready dict: schema, totals, standard errors, metadata and layers.

        ``totals`` and ``standard_error`` are derived (read for convenience, recomputed
        on loading). Non-finite floats are encoded as described in
        :meth:`LayerResult.to_dict`; in ``metadata`` and ``details`` they are the
        tagged object ``{"$float": "inf"}``, a tuple is ``{"$tuple": [...]}``, a
        numpy array ``{"$array": [...], "dtype": ..., "shape": [...]}``, and a dict
        with a key starting with ``$`` is wrapped as ``{"$dict": {...}}``; values
        JSON cannot hold (other objects) are stored as their ``repr`` string.
        """
        return {
            "schema": SCHEMA,
            "totals": _encode_measure_dict(self.totals),
            "standard_error": _encode_measure_dict(self.standard_error),
            "metadata": _encode_value(self.metadata),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self, path: str | Path | None = None, *, indent: int = 2) -> str:
        """Serialize to strict JSON (no NaN/Infinity literals) in the :data:`SCHEMA` layout.

        :meth:`from_json` and :func:`load_report` read it back exactly.

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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Report":
        """Inverse of :meth:`to_dict`: the report exactly as it was written.

        Reads the current schema and files written before the schema was
        versioned (no ``"schema"`` key; their ``null`` sigmas were optima at
        infinity and read as ``inf``, their metadata as plain JSON, and they hold
        no per-group values, so the total's standard error is ``None``).

        Raises:
            ValueError: If ``data`` is not a normflat report, or was written by a
                newer normflat in a schema version this one cannot read.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"A normflat report is a JSON object; got {type(data).__name__}.")
        schema = data.get("schema")
        if schema is None:
            if "layers" not in data:
                raise ValueError("Not a normflat report: it has neither a 'schema' nor a 'layers' entry.")
            tagged = False  # the unversioned format of normflat 0.1 before the schema
        else:
            match = _SCHEMA_RE.fullmatch(str(schema))
            if match is None:
                raise ValueError(
                    f"Not a normflat report: its schema is {schema!r}, not {SCHEMA!r}."
                )
            version = int(match.group(1))
            if version > _SCHEMA_VERSION:
                raise ValueError(
                    f"This report is in schema {schema!r}, written by a newer normflat; this normflat "
                    f"reads {SCHEMA!r} and older. Upgrade normflat (pip install -U normflat) to read it."
                )
            if version < 1:
                raise ValueError(f"Unknown report schema {schema!r}; this normflat reads {SCHEMA!r}.")
            tagged = True
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise ValueError("Not a normflat report: 'layers' must be a list of layer objects.")
        metadata = data.get("metadata") or {}
        return cls(
            layers=[_layer_from_dict(d, tagged=tagged, where=f"layer {i}") for i, d in enumerate(layers)],
            metadata=_decode_value(metadata) if tagged else dict(metadata),
        )

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "Report":
        """Read a report written by :meth:`to_json`, from a file path or the JSON text itself.

        Args:
            source: A path (``str`` or path-like) of a ``.json`` file, or JSON text
                (a string starting with ``{``).

        Raises:
            FileNotFoundError: If ``source`` is a path that does not exist.
            ValueError: If the text is not JSON, or not a report this normflat reads.
        """
        if isinstance(source, str) and source.lstrip().startswith("{"):
            text, where = source, "the JSON text"
        else:
            text, where = Path(source).read_text(encoding="utf-8"), str(source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON ({err}); expected a report written by "
                             "Report.to_json.") from None
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def compare(self, *others: "Report", labels: Sequence[str] | None = None,
                measures: Sequence[str] = ("normalized_sharpness", "hessian_trace")) -> "ReportComparison":
        """This report beside ``others``, per layer; see :func:`compare_reports`."""
        return compare_reports([self, *others], labels=labels, measures=measures)

    def __eq__(self, other: object) -> bool:
        # Same layers (value equality, see LayerResult) and the same metadata.
        if not isinstance(other, Report):
            return NotImplemented
        return _same(self.layers, other.layers) and _same(self.metadata, other.metadata)

    __hash__ = None  # type: ignore[assignment]

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
        title = "normflat report" + (f" ({self._meta_line()})" if self._meta_line() else "")
        notes = []
        if any(not layer.converged for layer in self.layers):
            notes.append("! solver stopped at max_iter before reaching its tolerance")
        n = len(self.layers)
        return _text_table(title, header, rows[:n], rows[n:], notes)

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




# --- JSON encoding (schema normflat.report/1) -----------------------------------------
#
# Strict JSON has no NaN or Infinity. Numeric fields of the schema (measures, sigmas,
# imbalance, standard errors, group values) hold the strings "inf", "-inf" and "nan"
# where the value is not finite: `float()` and numpy read them back, and an optimum at
# infinity (a degenerate row's sigma) stays distinct from NaN. Free-form fields
# (metadata, details) can hold any string, so there a non-finite float is the tagged
# object {"$float": "inf"} instead, and tuples and arrays are tagged likewise so that
# they come back as the same type.

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode_float(value: Any) -> float | str:
    x = float(value)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _encode_floats(values: Any) -> list[float | str]:
    return [_encode_float(v) for v in np.asarray(values, dtype=np.float64).ravel()]


def _encode_measure_dict(values: Mapping[str, float] | None) -> dict[str, float | str] | None:
    return None if values is None else {str(k): _encode_float(v) for k, v in values.items()}


def _decode_float(value: Any, where: str, *, none: float | None = None) -> float:
    """A numeric field: a JSON number or one of the strings of :data:`_NONFINITE`.

    ``none`` is what ``null`` stands for (unversioned files wrote ``null`` for an
    infinite sigma); ``None`` refuses it.
    """
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if value is None and none is not None:
        return none
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number or one of 'inf', '-inf', 'nan'; got {value!r}.")
    return float(value)


def _decode_floats(values: Any, where: str, *, none: float | None = None) -> np.ndarray:
    if not isinstance(values, list):
        raise ValueError(f"{where} must be a list of numbers; got {type(values).__name__}.")
    return np.array([_decode_float(v, where, none=none) for v in values], dtype=np.float64)


def _decode_measure_dict(values: Any, where: str) -> dict[str, float] | None:
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object of numbers or null; got {type(values).__name__}.")
    return {str(k): _decode_float(v, f"{where}[{k!r}]") for k, v in values.items()}


def _encode_value(value: Any) -> Any:
    """A free-form value (metadata, details) as tagged JSON; inverse :func:`_decode_value`."""
    if isinstance(value, dict):
        out = {str(k): _encode_value(v) for k, v in value.items()}
        # A key starting with "$" would read as a tag: wrap such a dict.
        return {"$dict": out} if any(k.startswith("$") for k in out) else out
    if isinstance(value, tuple):
        return {"$tuple": [_encode_value(v) for v in value]}
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        x = float(value)
        return x if math.isfinite(x) else {"$float": _encode_float(x)}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"$array": [_encode_value(v) for v in value.ravel().tolist()], "dtype": value.dtype.str,
                "shape": list(value.shape)}
    if value is None:
        return None
    if isinstance(value, str):
        return str(value)  # np.str_ too
    return repr(value)  # not representable in JSON: kept readable, read back as a string


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: _decode_value(v) for k, v in value.items()}
    if tags == ["$dict"] and len(value) == 1 and isinstance(value["$dict"], dict):
        return {k: _decode_value(v) for k, v in value["$dict"].items()}
    if tags == ["$tuple"] and len(value) == 1 and isinstance(value["$tuple"], list):
        return tuple(_decode_value(v) for v in value["$tuple"])
    if tags == ["$float"] and len(value) == 1:
        return _decode_float(value["$float"], "a tagged float")
    if tags == ["$array"] and set(value) == {"$array", "dtype", "shape"}:
        flat = [_decode_value(v) for v in value["$array"]]
        return np.array(flat, dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    raise ValueError(f"Unknown tagged value {sorted(value)!r} in the report's metadata or details.")


_LAYER_KEYS = ("name", "kind", "shape", *MEASURES, "row_sigma", "col_sigma", "iterations", "imbalance",
               "converged", "degenerate_rows", "degenerate_cols", "clipped")


def _layer_from_dict(data: Any, *, tagged: bool, where: str) -> LayerResult:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object; got {type(data).__name__}.")
    missing = [k for k in _LAYER_KEYS if k not in data]
    if missing:
        raise ValueError(f"{where} ({data.get('name', '?')!r}) lacks {', '.join(missing)}.")
    where = f"{where} ({data['name']!r})"
    groups = data.get("group_values")
    if groups is not None and not isinstance(groups, dict):
        raise ValueError(f"{where}: group_values must be an object of lists or null.")
    details = data.get("details") or {}
    try:
        return LayerResult(
            name=str(data["name"]),
            kind=str(data["kind"]),
            shape=tuple(int(n) for n in data["shape"]),
            **{m: _decode_float(data[m], f"{where}: {m}") for m in MEASURES},
            # null sigmas come from unversioned files, which wrote null for an
            # optimum at infinity (the only non-finite sigma the solver produces).
            row_sigma=_decode_floats(data["row_sigma"], f"{where}: row_sigma", none=math.inf),
            col_sigma=_decode_floats(data["col_sigma"], f"{where}: col_sigma", none=math.inf),
            iterations=int(data["iterations"]),
            imbalance=_decode_float(data["imbalance"], f"{where}: imbalance"),
            converged=bool(data["converged"]),
            degenerate_rows=tuple(int(i) for i in data["degenerate_rows"]),
            degenerate_cols=tuple(int(j) for j in data["degenerate_cols"]),
            clipped=int(data["clipped"]),
            standard_error=_decode_measure_dict(data.get("standard_error"), f"{where}: standard_error"),
            details=_decode_value(details) if tagged else dict(details),
            _group_values=None if groups is None else {
                str(m): _decode_floats(v, f"{where}: group_values[{m!r}]") for m, v in groups.items()},
        )
    except (TypeError, KeyError) as err:
        raise ValueError(f"{where} is malformed: {err}.") from None


def _same(a: Any, b: Any) -> bool:
    """Exact equality of report fields: arrays by shape, dtype and elements (NaN equal to
    NaN), containers by type and items, floats with NaN equal to NaN."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b  # True is not 1 in metadata
    return bool(a == b)


def load_report(path: str | os.PathLike) -> Report:
    """Read a report file written by :meth:`Report.to_json` (any schema version up to :data:`SCHEMA`).

    Raises:
        FileNotFoundError: If there is no such file.
        ValueError: If the file is not a normflat report this version reads.
    """
    return Report.from_json(Path(path))


# --- comparison of reports ---------------------------------------------------------------

_SHORT_LABELS = {
    "normalized_sharpness": "norm. sharpness",
    "matrix_normalized_sharpness": "matrix-norm.",
    "hessian_trace": "Hessian trace",
    "elementwise_bound": "elementwise",
}


@dataclass(frozen=True, eq=False)
class ReportComparison:
    """Several reports side by side, per layer, as made by :func:`compare_reports`.

    Layers are matched by name; a layer that one report lacks has the value
    ``None`` for that report (shown as ``missing``). ``print(comparison)`` gives
    the text table, notebooks show it as HTML, :meth:`to_dataframe` gives a pandas
    DataFrame and :meth:`plot` the figure.

    Attributes:
        reports: The reports, in the order given.
        labels: One unique label per report.
        measures: The measures shown (of ``normflat.MEASURES``).
        layer_names: Every layer name, in the first report's order, then the layers
            only later reports have, in their order.
    """

    reports: tuple[Report, ...]
    labels: tuple[str, ...]
    measures: tuple[str, ...]
    layer_names: tuple[str, ...]

    def value(self, measure: str, layer: str, label: str) -> float | None:
        """``measure`` of ``layer`` in the report labelled ``label``; ``None`` if it lacks the layer."""
        found = _layers_by_name(self.reports[self.labels.index(label)]).get(layer)
        return None if found is None else getattr(found, measure)

    def total(self, measure: str, label: str) -> float:
        """The total ``measure`` of the report labelled ``label`` (over its own layers)."""
        return getattr(self.reports[self.labels.index(label)], measure)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per layer and a last one for the totals:
        ``{"layer", "kind", "shape", measure: {label: value or None}}`` (kind and
        shape from the first report that has the layer; the totals' shape is ``None``)."""
        by_name = [_layers_by_name(r) for r in self.reports]
        rows = []
        for name in self.layer_names:
            present = [layers[name] for layers in by_name if name in layers]
            row: dict[str, Any] = {"layer": name, "kind": present[0].kind, "shape": tuple(present[0].shape)}
            for m in self.measures:
                row[m] = {label: (getattr(layers[name], m) if name in layers else None)
                          for label, layers in zip(self.labels, by_name)}
            rows.append(row)
        total: dict[str, Any] = {"layer": "total", "kind": "", "shape": None}
        for m in self.measures:
            total[m] = {label: getattr(r, m) for label, r in zip(self.labels, self.reports)}
        rows.append(total)
        return rows

    @property
    def missing(self) -> dict[str, list[str]]:
        """``{label: [layer names that report lacks]}`` for the reports that lack any."""
        out = {}
        for label, report in zip(self.labels, self.reports):
            names = _layers_by_name(report)
            absent = [n for n in self.layer_names if n not in names]
            if absent:
                out[label] = absent
        return out

    def to_dataframe(self) -> Any:
        """The table as a pandas DataFrame: index the layers and ``total``, columns
        ``(measure, label)`` plus ``kind`` and ``shape``; missing values are NaN.

        Raises:
            ImportError: If pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError(
                "ReportComparison.to_dataframe() needs pandas; install it with `pip install pandas` "
                "(or `pip install normflat[all]`); `comparison.rows` has the same table as dicts."
            ) from err
        rows = self.rows
        columns = [("kind", ""), ("shape", "")] + [(m, label) for m in self.measures for label in self.labels]
        data = [[row["kind"], "" if row["shape"] is None else row["shape"]]
                + [math.nan if row[m][label] is None else row[m][label] for m in self.measures
                   for label in self.labels] for row in rows]
        return pd.DataFrame(data, index=pd.Index([row["layer"] for row in rows], name="layer"),
                            columns=pd.MultiIndex.from_tuples(columns, names=["measure", "report"]))

    def plot(self, measure: str = "normalized_sharpness", path: str | os.PathLike | None = None,
             **kwargs: Any) -> Any:
        """Grouped bars per layer and the totals (matplotlib); see
        :func:`normflat.plotting.plot_comparison`."""
        from normflat.plotting import plot_comparison

        return plot_comparison(self, measure=measure, path=path, **kwargs)

    def _table(self) -> tuple[list[tuple[str, int]], list[str], list[list[str]], list[list[str]]]:
        ratio = len(self.labels) == 2  # two reports (before/after): their ratio reads best
        sub = [*self.labels, f"{self.labels[1]}/{self.labels[0]}"] if ratio else list(self.labels)
        groups = [("", 3)] + [(_SHORT_LABELS[m], len(sub)) for m in self.measures]
        header = ["layer", "kind", "shape"] + sub * len(self.measures)
        body = []
        for row in self.rows:
            cells = [row["layer"], row["kind"], "x".join(map(str, row["shape"] or ()))]
            for m in self.measures:
                values = [row[m][label] for label in self.labels]
                cells += ["missing" if v is None else _fmt(v) for v in values]
                if ratio:
                    a, b = values
                    cells.append("" if a is None or b is None or a == 0 else _fmt(b / a))
            body.append(cells)
        return groups, header, body[:-1], body[-1:]

    def __str__(self) -> str:
        groups, header, body, footer = self._table()
        title = f"normflat comparison of {len(self.reports)} reports: {', '.join(self.labels)}"
        notes = []
        if self.missing:
            notes.append("missing: the layer is not in that report (layers are matched by name); each "
                         "total sums its own report's layers")
        return _text_table(title, header, body, footer, notes, groups=groups)

    def _repr_html_(self) -> str:
        groups, header, body, footer = self._table()
        top = "".join(f"<th colspan='{n}'>{html.escape(t)}</th>" for t, n in groups)
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body + footer)
        caption = html.escape(", ".join(self.labels))
        return (f"<table class='normflat-comparison'><caption>normflat comparison: {caption}</caption>"
                f"<thead><tr>{top}</tr><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")

    def __repr__(self) -> str:
        return (f"ReportComparison(labels={list(self.labels)}, layers={len(self.layer_names)}, "
                f"measures={list(self.measures)})")


def _layers_by_name(report: Report) -> dict[str, LayerResult]:
    return {layer.name: layer for layer in report.layers}


def compare_reports(
    reports: Sequence[Report | str | os.PathLike] | Mapping[str, Report | str | os.PathLike],
    labels: Sequence[str] | None = None,
    *,
    measures: Sequence[str] = ("normalized_sharpness", "hessian_trace"),
) -> ReportComparison:
    """Put reports side by side per layer, e.g. a checkpoint before and after fine-tuning.

    Layers are matched by name; a layer only some reports have is shown as
    ``missing`` in the others.

    Args:
        reports: The reports, or paths of report files (read with
            :func:`load_report`), as a list or as ``{label: report}``.
        labels: One unique label per report (default: the mapping's keys, a file's
            name without ``.json``, else ``report 1``, ``report 2``, ...).
        measures: The measures to show, of ``normflat.MEASURES``.

    Returns:
        A :class:`ReportComparison`: ``print`` it for the table, ``.to_dataframe()``
        for pandas, ``.rows`` for plain dicts, ``.plot()`` for the figure.

    Raises:
        TypeError: If an item is neither a :class:`Report` nor a path.
        ValueError: For no reports, labels that do not match them one to one, an
            unknown measure, or a report whose layer names repeat.
    """
    if isinstance(reports, Mapping):
        if labels is not None:
            raise ValueError("Pass labels either as the mapping's keys or as labels=, not both.")
        labels = [str(k) for k in reports]
        reports = list(reports.values())
    items = list(reports)
    if not items:
        raise ValueError("compare_reports() needs at least one report.")
    loaded, default_labels = [], []
    for i, item in enumerate(items):
        if isinstance(item, Report):
            loaded.append(item)
            default_labels.append(f"report {i + 1}")
        elif isinstance(item, (str, os.PathLike)):
            loaded.append(load_report(item))
            name = Path(item).name
            default_labels.append(name[: -len(".json")] if name.endswith(".json") else name)
        else:
            raise TypeError(f"compare_reports() takes Report objects or report file paths; item {i} is "
                            f"a {type(item).__name__}.")
    labels = default_labels if labels is None else [str(label) for label in labels]
    if len(labels) != len(loaded):
        raise ValueError(f"{len(labels)} labels for {len(loaded)} reports; pass one label per report.")
    if len(set(labels)) != len(labels):
        raise ValueError(f"Labels must be unique, got {labels}.")
    measures = tuple(measures)
    unknown = [m for m in measures if m not in MEASURES]
    if unknown or not measures:
        raise ValueError(f"Unknown measures {unknown}; choose from {', '.join(MEASURES)}.")
    names: list[str] = []
    for label, report in zip(labels, loaded):
        own = [layer.name for layer in report.layers]
        repeated = sorted({n for n in own if own.count(n) > 1})
        if repeated:
            raise ValueError(f"Report {label!r} has repeated layer names {repeated}; layers are matched "
                             "by name, so each must be unique.")
        names += [n for n in own if n not in names]
    return ReportComparison(reports=tuple(loaded), labels=tuple(labels), measures=measures,
                            layer_names=tuple(names))


def _text_table(title: str, header: list[str], body: list[list[str]], footer: list[list[str]],
                notes: Sequence[str] = (), *, groups: Sequence[tuple[str, int]] = (), left: int = 3) -> str:
    """A plain-text table: title, header line(s), rule, body, rule, footer, notes.

    The first ``left`` columns are left-aligned (names), the others right-aligned
    (numbers). ``groups`` is an optional line above the header of ``(text, n)``
    spans, each over the next ``n`` columns (a measure over its reports).
    """
    everything = [header, *body, *footer]
    widths = [max(len(r[i]) for r in everything) for i in range(len(header))]
    start = 0
    for text, n in groups:  # widen a group's last column if its title is wider than it
        span = sum(widths[start:start + n]) + 2 * (n - 1)
        widths[start + n - 1] += max(0, len(text) - span)
        start += n

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [title]
    if groups:
        cells, start = [], 0
        for text, n in groups:
            cells.append(text.ljust(sum(widths[start:start + n]) + 2 * (n - 1)))
            start += n
        out.append("  ".join(cells).rstrip())
    out += [line(header), rule, *(line(r) for r in body), rule, *(line(r) for r in footer), *notes]
    return "\n".join(out)
