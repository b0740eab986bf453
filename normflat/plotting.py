"""Figures (matplotlib): per-layer bars of a report, the study scatter plots, the invariance plot.

matplotlib is an optional dependency (``pip install matplotlib`` or
``normflat[all]``). The ``save_*`` functions draw on a standalone
:class:`matplotlib.figure.Figure`, so they work without a display and leave
pyplot's global state alone; :func:`plot_report` without ``ax`` uses pyplot so
that the figure shows in notebooks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from normflat.core.report import MEASURES

__all__ = [
    "plot_report",
    "plot_study",
    "plot_invariance",
    "save_study_figure",
    "save_layers_figure",
    "save_invariance_figure",
]

_LABELS = {
    "normalized_sharpness": "normalized sharpness",
    "matrix_normalized_sharpness": "matrix-normalized sharpness",
    "hessian_trace": "Hessian trace",
    "elementwise_bound": "elementwise bound",
}


def _require_matplotlib() -> None:
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


def _new_figure(**kwargs: Any) -> Any:
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
    _require_matplotlib()
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


def plot_study(result: Any, *, measures: Sequence[str] = MEASURES, figure: Any = None) -> Any:
    """Generalization gap against each measure, one point per model, coloured by label ratio.

    One row of panels per arm (trained; rescaled when the study ran the
    reparametrization arm), one column per measure; Kendall's tau in each title.

    Args:
        result: A :class:`normflat.study.StudyResult`.
        measures: The measures to show.
        figure: A matplotlib Figure to draw on (default: a new standalone one).

    Returns:
        The Figure.
    """
    _require_matplotlib()
    from matplotlib import cm, colors, ticker

    rows = result.rows
    arms = [("trained", "")] + ([("rescaled", "rescaled_")] if "rescaled" in result.correlations else [])
    fig = figure or _new_figure(figsize=(3.6 * len(measures), 3.3 * len(arms) + 0.6), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(arms), len(measures), squeeze=False))
    norm = colors.Normalize(vmin=0.0, vmax=1.0)
    cmap = cm.viridis
    gap = np.array([r["gap"] for r in rows], dtype=float)
    ratio = np.array([r["ratio"] for r in rows], dtype=float)
    for a, (arm, prefix) in enumerate(arms):
        for k, m in enumerate(measures):
            ax = axes[a, k]
            vals = np.array([np.nan if r.get(prefix + m) is None else r[prefix + m] for r in rows], dtype=float)
            ax.scatter(vals, gap, c=ratio, cmap=cmap, norm=norm, s=28, edgecolors="k", linewidths=0.4)
            if np.all(vals[np.isfinite(vals)] > 0) and np.isfinite(vals).any():
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # minor labels overlap
            tau = result.correlations[arm][m]["tau"]
            tau_text = "n/a" if tau is None else f"{tau:.3f}"
            ax.set_title(f"{_LABELS[m]}\n{arm}: Kendall τ = {tau_text}", fontsize=10)
            ax.set_xlabel(_LABELS[m] + (" (rescaled model)" if prefix else ""), fontsize=9)
            if k == 0:
                ax.set_ylabel("generalization gap\n(train acc. − test acc.)")
            ax.grid(alpha=0.3)
    cfg = result.config
    fig.suptitle(f"Random-label study: {cfg['dataset']}, {cfg['arch']}, {len(rows)} models "
                 f"(estimator {cfg['estimator']}, loss {cfg['loss']})")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="random-label ratio", shrink=0.8)
    return fig


def save_study_figure(result: Any, path: str, **kwargs: Any) -> str:
    """Draw :func:`plot_study` into a PNG file; returns the path."""
    fig = plot_study(result, **kwargs)
    fig.savefig(path, dpi=110)
    return str(path)


def save_layers_figure(reports: Mapping[str, Any], path: str, *, measures: Sequence[str] = ("normalized_sharpness", "hessian_trace"), title: str = "") -> str:
    """Per-layer bars of one model, for each report given (e.g. trained and rescaled).

    Args:
        reports: ``{label: Report}``; the bars of each label sit side by side.
        path: PNG path.
        measures: One panel per measure.
        title: Figure title.
    """
    _require_matplotlib()
    fig = _new_figure(figsize=(5.0 * len(measures), 3.8), layout="constrained")
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


def plot_invariance(rows: Sequence[Mapping[str, Any]], *, measures: Sequence[str] = MEASURES, ax: Any = None) -> Any:
    """Each measure of a rescaled model divided by the original's, against the rescaling spread.

    Args:
        rows: Dicts with ``"orders"`` (decades ``r`` of the factor draw) and, per
            measure, ``"<measure>_ratio"``.
        measures: Measures to draw.
        ax: Axes to draw on (default: a new standalone figure).

    Returns:
        The Axes.
    """
    _require_matplotlib()
    if ax is None:
        ax = _new_figure(figsize=(6.4, 4.2), layout="constrained").subplots()
    orders = [r["orders"] for r in rows]
    # Invariant measures overlap at 1: big hollow markers and dashes keep both visible.
    styles = {
        "normalized_sharpness": dict(marker="o", ms=11, mfc="none", mew=2, lw=2.5),
        "matrix_normalized_sharpness": dict(marker="s", ms=6),
        "hessian_trace": dict(marker="^", ms=6),
        "elementwise_bound": dict(marker="D", ms=5, ls="--"),
    }
    for m in measures:
        ratio = [r[f"{m}_ratio"] for r in rows]
        ax.plot(orders, ratio, label=_LABELS[m], **styles.get(m, {"marker": "o"}))
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.6, ls="--")
    ax.set_xlabel("rescaling factors drawn from [10^-r, 10^r]: r (decades)")
    ax.set_ylabel("measure after rescaling / before")
    ax.set_title("Same function, rescaled parameters")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    lo = min(min(r[f"{m}_ratio"] for m in measures) for r in rows)
    hi = max(max(r[f"{m}_ratio"] for m in measures) for r in rows)
    if math.isfinite(lo) and math.isfinite(hi) and lo > 0:
        ax.set_ylim(min(lo, 0.5) / 2, max(hi, 2.0) * 2)
    return ax


def save_invariance_figure(rows: Sequence[Mapping[str, Any]], path: str, **kwargs: Any) -> str:
    """Draw :func:`plot_invariance` into a PNG file; returns the path."""
    ax = plot_invariance(rows, **kwargs)
    ax.figure.savefig(path, dpi=110)
    return str(path)
