"""Figures of reports (matplotlib): per-layer bars of one or several reports.

The figures of study results (the random-label scatter plots, the invariance
plot) live with the study, in :mod:`normflat.study.figures`; this module never
imports :mod:`normflat.study`, nor :mod:`normflat.core.report` (the measure names
come from :mod:`normflat.core.constants`), so ``Report.plot`` can import it
without a cycle.

:func:`plot_comparison` draws a :class:`~normflat.core.report.ReportComparison`
(duck-typed, for the same reason).

matplotlib is an optional dependency (``pip install matplotlib`` or
``normflat[all]``). :func:`save_layers_figure` draws on a standalone
:class:`matplotlib.figure.Figure`, so it works without a display and leaves
pyplot's global state alone; :func:`plot_report` without ``ax`` uses pyplot so
that the figure shows in notebooks.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from normflat.core.constants import MEASURE_LABELS, MEASURES

__all__ = ["plot_comparison", "plot_report", "save_layers_figure"]

_LABELS = MEASURE_LABELS


def require_matplotlib() -> None:
    """Raise an ImportError that says how to install matplotlib, if it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "normflat's figures need matplotlib; install it with `pip install matplotlib` "
            "(or `pip install normflat[all]`)."
        ) from err


def _check_measure(measure: str) -> None:
    if measure not in MEASURES:
        raise ValueError(f"Unknown measure {measure!r}; choose one of {', '.join(MEASURES)}.")


def new_figure(**kwargs: Any) -> Any:
    """A standalone matplotlib Figure (no pyplot state, works without a display)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def plot_report(report: Any, measure: str = "normalized_sharpness", ax: Any = None, *,
                log: bool = False, label: str | None = None, **bar_kwargs: Any) -> Any:
    """Bar chart of one measure per layer of a :class:`~normflat.Report`.

    Args:
        report: The report.
        measure: One of ``normalized_sharpness``, ``matrix_normalized_sharpness``,
            ``hessian_trace``, ``elementwise_bound``.
        ax: Axes to draw on; ``None`` creates a new pyplot figure.
        log: Logarithmic value axis.
        label: Legend label of the bars.
        **bar_kwargs: Passed to ``Axes.bar``.

    Returns:
        The matplotlib Axes.
    """
    require_matplotlib()
    _check_measure(measure)
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(report.layers) + 2), 3.5))
    names = [layer.name for layer in report.layers]
    values = [getattr(layer, measure) for layer in report.layers]
    errors = None
    if all(layer.standard_error for layer in report.layers) and report.layers:
        errors = [layer.standard_error[measure] for layer in report.layers]
    ax.bar(range(len(names)), values, yerr=errors, label=label, capsize=3 if errors else 0, **bar_kwargs)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set_ylabel(_LABELS[measure])
    ax.set_xlabel("layer")
    total = getattr(report, measure)
    ax.set_title(f"{_LABELS[measure]} per layer (total {total:.4g})")
    if log:
        ax.set_yscale("log")
    return ax


def save_layers_figure(reports: Mapping[str, Any], path: str, *, measures: Sequence[str] = ("normalized_sharpness", "hessian_trace"), title: str = "") -> str:
    """Per-layer bars of one model, for each report given (e.g. trained and rescaled).

    Args:
        reports: ``{label: Report}``; the bars of each label sit side by side.
        path: PNG path.
        measures: One panel per measure.
        title: Figure title.
    """
    require_matplotlib()
    fig = new_figure(figsize=(5.0 * len(measures), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(measures), squeeze=False)[0])
    width = 0.8 / max(len(reports), 1)
    for ax, m in zip(axes, measures):
        for i, (label, report) in enumerate(reports.items()):
            x = np.arange(len(report.layers)) + (i - (len(reports) - 1) / 2) * width
            ax.bar(x, [getattr(layer, m) for layer in report.layers], width=width,
                   label=f"{label} (total {getattr(report, m):.4g})")
        first = next(iter(reports.values()))
        ax.set_xticks(np.arange(len(first.layers)))
        ax.set_xticklabels([layer.name for layer in first.layers])
        ax.set_xlabel("layer")
        ax.set_ylabel(_LABELS[m])
        values = np.array([getattr(layer, m) for r in reports.values() for layer in r.layers], dtype=float)
        positive = values[np.isfinite(values) & (values > 0)]
        if positive.size == values.size and positive.size and positive.max() > 20 * positive.min():
            ax.set_yscale("log")  # only when the bars span decades; else a linear axis reads better
        ax.set_title(_LABELS[m] + " per layer")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return str(path)


def plot_comparison(comparison: Any, measure: str = "normalized_sharpness", *, path: Any = None,
                    title: str = "", log: bool | None = None) -> Any:
    """Per-layer grouped bars of several reports side by side, and their totals.

    Left panel: one group of bars per layer, one bar per report (a layer that a
    report lacks gets no bar but a ``missing`` mark). Right panel: each report's
    total. Made by :meth:`ReportComparison.plot` and
    ``normflat.compare_reports(...).plot()``.

    Args:
        comparison: A :class:`~normflat.core.report.ReportComparison`.
        measure: One of ``normalized_sharpness``, ``matrix_normalized_sharpness``,
            ``hessian_trace``, ``elementwise_bound``.
        path: If given, the figure is also saved there (PNG, or any format
            matplotlib knows from the suffix).
        title: Figure title.
        log: Logarithmic value axes; ``None`` (default) chooses it when the bars
            span more than a factor of 20.

    Returns:
        The standalone matplotlib Figure.
    """
    require_matplotlib()
    _check_measure(measure)
    labels, names = list(comparison.labels), list(comparison.layer_names)
    fig = new_figure(figsize=(max(6.0, 0.45 * len(names) * len(labels) + 4.0), 3.8), layout="constrained")
    ax, ax_total = fig.subplots(1, 2, width_ratios=[max(len(names), 1), max(1.5, 0.5 * len(labels))])
    width = 0.8 / len(labels)
    values = np.array([[np.nan if (v := comparison.value(measure, n, label)) is None else v for n in names]
                       for label in labels], dtype=float)
    totals = np.array([comparison.total(measure, label) for label in labels], dtype=float)
    shown = np.concatenate([values[np.isfinite(values)], totals[np.isfinite(totals)]])
    if log is None:
        positive = shown[shown > 0]
        log = positive.size == shown.size and positive.size > 0 and positive.max() > 20 * positive.min()
    for i, label in enumerate(labels):
        x = np.arange(len(names)) + (i - (len(labels) - 1) / 2) * width
        present = np.isfinite(values[i])
        ax.bar(x[present], values[i][present], width=width, color=f"C{i}", label=label)
        for xm in x[~present]:  # a layer this report lacks: say so where its bar would be
            ax.text(xm, 0.0, "missing", rotation=90, ha="center", va="bottom", fontsize=7, color="0.4",
                    transform=ax.get_xaxis_transform())
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set_xlabel("layer")
    ax.set_ylabel(_LABELS[measure])
    ax.set_title(f"{_LABELS[measure]} per layer")
    ax.legend(fontsize=8)
    ax_total.bar(np.arange(len(labels)), totals, color=[f"C{i}" for i in range(len(labels))])
    ax_total.set_xticks(np.arange(len(labels)))
    ax_total.set_xticklabels(labels, rotation=30 if len(labels) > 3 else 0,
                             ha="right" if len(labels) > 3 else "center")
    ax_total.set_title("total")
    if log:
        ax.set_yscale("log")
        ax_total.set_yscale("log")
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
