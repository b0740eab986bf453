"""Figures of study results (matplotlib): the random-label scatter plots and the invariance plot.

They draw what :func:`normflat.study.run_study` and ``normflat invariance``
compute, so they live with the study; the figures of a single report (per-layer
bars) are in :mod:`normflat.plotting`. matplotlib is an optional dependency; the
figures are drawn on standalone :class:`matplotlib.figure.Figure` objects, so they
work without a display and leave pyplot's global state alone.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from normflat.core.constants import MEASURE_LABELS as _LABELS
from normflat.core.constants import MEASURES
from normflat.plotting import new_figure, require_matplotlib

__all__ = ["plot_study", "save_study_figure", "plot_invariance", "save_invariance_figure"]


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
    require_matplotlib()
    from matplotlib import cm, colors, ticker

    rows = result.rows
    arms = [("trained", "")] + ([("rescaled", "rescaled_")] if "rescaled" in result.correlations else [])
    fig = figure or new_figure(figsize=(3.6 * len(measures), 3.3 * len(arms) + 0.6), layout="constrained")
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
    # A grid on clean labels (the paper's section 6.2) is not a random-label study.
    kind = "Random-label study" if len({row["ratio"] for row in rows}) > 1 else "Study"
    fig.suptitle(f"{kind}: {cfg['dataset']}, {cfg.get('model') or cfg.get('arch')}, {len(rows)} models "
                 f"(estimator {cfg['estimator']}, loss {cfg['loss']})")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="random-label ratio", shrink=0.8)
    return fig


def save_study_figure(result: Any, path: str, **kwargs: Any) -> str:
    """Draw :func:`plot_study` into a PNG file; returns the path."""
    fig = plot_study(result, **kwargs)
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
    require_matplotlib()
    if ax is None:
        ax = new_figure(figsize=(6.4, 4.2), layout="constrained").subplots()
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
