"""Figures: per-layer bars (normflat.plotting), the study scatter plots and the invariance
plot (normflat.study.figures), with matplotlib's Agg backend."""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import normflat  # noqa: E402
from normflat.core.constants import MEASURES  # noqa: E402
from normflat.plotting import plot_report, save_layers_figure  # noqa: E402
from normflat.study.figures import plot_invariance, plot_study, save_invariance_figure, save_study_figure  # noqa: E402
from normflat.study.run import StudyResult, correlations  # noqa: E402


def small_report():
    rng = np.random.default_rng(0)
    problems = [normflat.LayerProblem(f"l{i}", rng.normal(size=(4, 3)), rng.random((4, 3))) for i in range(3)]
    return normflat.analyze(problems)


@pytest.mark.parametrize("measure", MEASURES)
def test_plot_report_bars_are_the_layer_values(measure):
    import matplotlib.pyplot as plt

    report = small_report()
    ax = report.plot(measure=measure)
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, [getattr(layer, measure) for layer in report.layers])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["l0", "l1", "l2"]
    assert f"{getattr(report, measure):.4g}" in ax.get_title()
    plt.close(ax.figure)


def test_plot_report_on_given_axes_and_bad_measure():
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    assert plot_report(small_report(), ax=ax, log=True) is ax
    assert ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="Unknown measure"):
        plot_report(small_report(), measure="trace", ax=ax)


def fake_result(reparam=True):
    rng = np.random.default_rng(1)
    rows = []
    for i, ratio in enumerate([0.0, 0.0, 0.5, 0.5, 1.0, 1.0]):
        row = {"run": i, "ratio": ratio, "seed": i % 2, "gap": ratio * 0.8 + 0.05 * rng.random(), "fitted": True}
        for m in MEASURES:
            row[m] = 10 + 100 * ratio + rng.random()
            row["rescaled_" + m] = row[m] * (1.0 if m in ("normalized_sharpness", "elementwise_bound") else 10 ** rng.uniform(-3, 3))
        rows.append(row)
    config = {"dataset": "digits", "arch": "mlp", "estimator": "ggn", "loss": "nsce"}
    return StudyResult(config=config, rows=rows, correlations=correlations(rows, reparam=reparam))


@pytest.mark.parametrize("reparam", [True, False])
def test_plot_study_titles_carry_tau(reparam):
    result = fake_result(reparam)
    fig = plot_study(result)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert len(axes) == 4 * (2 if reparam else 1)
    for ax, (arm, m) in zip(axes, [(a, m) for a in (["trained", "rescaled"] if reparam else ["trained"]) for m in MEASURES]):
        assert f"{result.correlations[arm][m]['tau']:.3f}" in ax.get_title()
        offsets = ax.collections[0].get_offsets()
        np.testing.assert_allclose(offsets[:, 1], [r["gap"] for r in result.rows])


def test_layers_and_invariance_figures(tmp_path):
    path = save_layers_figure({"a": small_report(), "b": small_report()}, str(tmp_path / "l.png"))
    assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("l.png")
    rows = [{"orders": r, **{f"{m}_ratio": (1.0 if m == "normalized_sharpness" else 10.0 ** r) for m in MEASURES}}
            for r in (0.0, 1.0, 2.0)]
    ax = plot_invariance(rows)
    assert ax.get_yscale() == "log"
    ydata = [list(line.get_ydata()) for line in ax.get_lines()]
    assert [1.0, 1.0, 1.0] in ydata and [1.0, 10.0, 100.0] in ydata


def test_study_figures_are_saved_from_the_study_package(tmp_path):
    path = save_study_figure(fake_result(), str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("s.png")
    rows = [{"orders": r, **{f"{m}_ratio": 1.0 + r for m in MEASURES}} for r in (0.0, 1.0)]
    path = save_invariance_figure(rows, str(tmp_path / "i.png"))
    assert (tmp_path / "i.png").read_bytes()[:4] == b"\x89PNG"
    import normflat.plotting

    # Report figures and study figures live apart: plotting has no study functions left.
    assert not hasattr(normflat.plotting, "plot_study") and not hasattr(normflat.plotting, "plot_invariance")
