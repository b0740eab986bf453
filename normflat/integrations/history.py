"""The measure-vs-step history kept by every training-time tracker.

Every integration (Keras, PyTorch Lightning, Hugging Face ``Trainer``, plain
PyTorch, JAX) appends one :class:`HistoryEntry` per analysis to a
:class:`TrackingHistory`, so the curves of a run look the same whatever framework
trained it. The history imports no framework; :meth:`TrackingHistory.plot`
imports matplotlib only when called.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from normflat.core.constants import MEASURE_LABELS, MEASURES

__all__ = ["HistoryEntry", "TrackingHistory"]


@dataclass(frozen=True)
class HistoryEntry:
    """One analysis during training.

    Attributes:
        step: Optimizer steps completed when the model was analyzed (the framework's
            global step).
        epoch: Zero-based epoch the analysis belongs to (``None`` when the loop does
            not say).
        totals: The four totals of method §4 by name (``normalized_sharpness``,
            ``matrix_normalized_sharpness``, ``hessian_trace``, ``elementwise_bound``).
        layers: Normalized sharpness per layer, in model order.
        layer_traces: Hessian trace per layer, in model order.
        report: The full :class:`~normflat.Report`, unless the tracker was built with
            ``keep_reports=False``.
    """

    step: int
    epoch: int | None
    totals: dict[str, float]
    layers: dict[str, float] = field(default_factory=dict)
    layer_traces: dict[str, float] = field(default_factory=dict)
    report: Any = None

    @classmethod
    def from_report(cls, report: Any, *, step: int, epoch: int | None, keep_report: bool = True) -> "HistoryEntry":
        """The entry of one analysis (a :class:`~normflat.Report`)."""
        return cls(
            step=int(step),
            epoch=None if epoch is None else int(epoch),
            totals={m: float(getattr(report, m)) for m in MEASURES},
            layers={layer.name: float(layer.normalized_sharpness) for layer in report.layers},
            layer_traces={layer.name: float(layer.hessian_trace) for layer in report.layers},
            report=report if keep_report else None,
        )

    def __getattr__(self, name: str) -> float:
        # entry.normalized_sharpness etc., like a Report
        totals = self.__dict__.get("totals")
        if totals is not None and name in totals:
            return totals[name]
        raise AttributeError(name)


class TrackingHistory(Sequence[HistoryEntry]):
    """The analyses of one training run, in order: a sequence of :class:`HistoryEntry`.

    Example:
        >>> tracker.history[-1].normalized_sharpness
        >>> tracker.history.steps, tracker.history.values("hessian_trace")
        >>> tracker.history.plot("curves.png")
        >>> pandas.DataFrame(tracker.history.to_records())
    """

    def __init__(self, entries: Sequence[HistoryEntry] = ()) -> None:
        self._entries: list[HistoryEntry] = list(entries)

    # ------------------------------------------------------------------ sequence

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return TrackingHistory(self._entries[index])
        return self._entries[index]

    def __iter__(self) -> Iterator[HistoryEntry]:
        return iter(self._entries)

    def __repr__(self) -> str:
        last = f", last step {self._entries[-1].step}" if self._entries else ""
        return f"TrackingHistory({len(self)} entries{last})"

    def append(self, entry: HistoryEntry) -> None:
        """Add one analysis (the trackers call this)."""
        if not isinstance(entry, HistoryEntry):
            raise TypeError(f"TrackingHistory holds HistoryEntry objects, got {type(entry).__name__}.")
        self._entries.append(entry)

    def clear(self) -> None:
        """Forget every entry (a tracker reused for a new run)."""
        self._entries.clear()

    # ------------------------------------------------------------------ columns

    @property
    def steps(self) -> list[int]:
        """The global step of every entry."""
        return [e.step for e in self._entries]

    @property
    def epochs(self) -> list[int | None]:
        """The epoch of every entry."""
        return [e.epoch for e in self._entries]

    @property
    def reports(self) -> list[Any]:
        """The kept reports (``None`` where ``keep_reports=False``)."""
        return [e.report for e in self._entries]

    @property
    def layer_names(self) -> list[str]:
        """Every layer seen, in first-seen order."""
        names: dict[str, None] = {}
        for e in self._entries:
            names.update(dict.fromkeys(e.layers))
        return list(names)

    def values(self, measure: str = "normalized_sharpness", layer: str | None = None) -> list[float]:
        """One measure per entry: a total, or with ``layer`` that layer's normalized
        sharpness (``measure="normalized_sharpness"``) or Hessian trace
        (``measure="hessian_trace"``); NaN where an entry lacks the layer."""
        if measure not in MEASURES:
            raise ValueError(f"Unknown measure {measure!r}; choose one of {', '.join(MEASURES)}.")
        if layer is None:
            return [e.totals[measure] for e in self._entries]
        if measure not in ("normalized_sharpness", "hessian_trace"):
            raise ValueError("The history keeps per-layer values of normalized_sharpness and hessian_trace only; "
                             f"read other per-layer measures from the kept reports, not {measure!r}.")
        column = "layers" if measure == "normalized_sharpness" else "layer_traces"
        return [getattr(e, column).get(layer, math.nan) for e in self._entries]

    # ------------------------------------------------------------------ export

    def to_records(self) -> list[dict[str, Any]]:
        """One flat dict per entry: ``step``, ``epoch``, the four totals, and
        ``normalized_sharpness/<layer>`` and ``hessian_trace/<layer>`` per layer
        (``pandas.DataFrame(history.to_records())`` gives a table)."""
        records = []
        for e in self._entries:
            row: dict[str, Any] = {"step": e.step, "epoch": e.epoch, **e.totals}
            row.update({f"normalized_sharpness/{k}": v for k, v in e.layers.items()})
            row.update({f"hessian_trace/{k}": v for k, v in e.layer_traces.items()})
            records.append(row)
        return records

    def to_csv(self, path: str | os.PathLike) -> str:
        """Write :meth:`to_records` as CSV (one row per entry); returns the path."""
        records = self.to_records()
        columns: dict[str, None] = dict.fromkeys(["step", "epoch", *MEASURES])
        for r in records:
            columns.update(dict.fromkeys(r))
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(records)
        return str(path)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The records as strict JSON (non-finite numbers as ``null``); written to
        ``path`` when given. Returns the JSON text."""
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        text = json.dumps({"entries": [{k: clean(v) for k, v in r.items()} for r in self.to_records()]}, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    # ------------------------------------------------------------------ figure

    def plot(self, path: str | os.PathLike | None = None, *, x: str = "step", layers: bool = True,
             title: str | None = None, figure: Any = None) -> Any:
        """Measure-vs-step curves on one figure.

        Left panel: the total normalized sharpness and, on a second y axis, the
        total Hessian trace. Right panel (``layers=True``): one line per layer's
        normalized sharpness. The y axes are logarithmic where the values are positive
        and span more than a decade.

        Args:
            path: Also save the figure here (PNG, SVG, PDF: any matplotlib format).
            x: ``"step"`` (default) or ``"epoch"`` on the horizontal axis.
            layers: Draw the per-layer panel.
            title: The figure title.
            figure: A matplotlib Figure to draw on (default: a new standalone one,
                no pyplot state, so it works without a display).

        Returns:
            The matplotlib Figure.

        Raises:
            ValueError: If the history is empty or ``x`` is unknown.
            ImportError: If matplotlib is not installed.
        """
        from normflat.plotting import new_figure, require_matplotlib

        if x not in ("step", "epoch"):
            raise ValueError(f"x must be 'step' or 'epoch', got {x!r}.")
        if not self._entries:
            raise ValueError("The history is empty: nothing was analyzed yet (check every_n_epochs/every_n_steps).")
        require_matplotlib()
        xs = [e.step if x == "step" else (math.nan if e.epoch is None else e.epoch + 1) for e in self._entries]
        fig = figure or new_figure(figsize=(11.0 if layers else 6.0, 4.0), layout="constrained")
        axes = fig.subplots(1, 2 if layers else 1, squeeze=False)[0]
        ax = axes[0]
        ns = self.values("normalized_sharpness")
        trace = self.values("hessian_trace")
        line_ns = ax.plot(xs, ns, marker="o", ms=3, color="C0", label=MEASURE_LABELS["normalized_sharpness"])
        ax.set_ylabel(MEASURE_LABELS["normalized_sharpness"], color="C0")
        _log_if_positive(ax, ns)
        twin = ax.twinx()
        line_tr = twin.plot(xs, trace, marker="s", ms=3, color="C3", ls="--", label=MEASURE_LABELS["hessian_trace"])
        twin.set_ylabel(MEASURE_LABELS["hessian_trace"], color="C3")
        _log_if_positive(twin, trace)
        lines = line_ns + line_tr
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="best")
        ax.set_xlabel("training step" if x == "step" else "epoch")
        ax.set_title("totals", fontsize=10)
        ax.grid(alpha=0.3)
        if layers:
            lax = axes[1]
            names = self.layer_names
            values = []
            for name in names:
                v = self.values("normalized_sharpness", layer=name)
                values.extend(v)
                lax.plot(xs, v, marker="o", ms=2, label=name)
            _log_if_positive(lax, values)
            lax.set_xlabel("training step" if x == "step" else "epoch")
            lax.set_ylabel("normalized sharpness per layer")
            lax.set_title("per layer", fontsize=10)
            lax.grid(alpha=0.3)
            if len(names) <= 12:
                lax.legend(fontsize=7, loc="best")
        if title:
            fig.suptitle(title)
        if path is not None:
            fig.savefig(path, dpi=110)
        return fig


def _log_if_positive(ax: Any, values: Sequence[float]) -> None:
    """A log y axis for positive values spanning more than a decade (a linear one
    reads better over a narrower range)."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and all(v > 0 for v in finite) and max(finite) / min(finite) > 10.0:
        ax.set_yscale("log")
