"""Reports side by side: matching by name, missing layers, table, DataFrame and figure."""

from __future__ import annotations

import math

import numpy as np
import pytest

import normflat
from normflat.core.report import ReportComparison


def make(names, seed):
    rng = np.random.default_rng(seed)
    return normflat.analyze([normflat.LayerProblem(n, rng.normal(size=(4, 3)), rng.random((4, 3))) for n in names])


@pytest.fixture
def pair():
    return make(["fc1", "fc2", "out"], 0), make(["fc1", "extra", "out"], 1)


def test_layers_matched_by_name_and_missing(pair):
    before, after = pair
    comp = normflat.compare_reports([before, after], labels=["before", "after"])
    assert isinstance(comp, ReportComparison)
    assert comp.layer_names == ("fc1", "fc2", "out", "extra")
    rows = comp.rows
    assert [r["layer"] for r in rows] == ["fc1", "fc2", "out", "extra", "total"]
    by = {r["layer"]: r for r in rows}
    ns = "normalized_sharpness"
    assert by["out"][ns] == {"before": before.layer("out").value, "after": after.layer("out").value}
    assert by["fc2"][ns]["after"] is None and by["extra"][ns]["before"] is None
    assert by["total"]["hessian_trace"] == {"before": before.hessian_trace, "after": after.hessian_trace}
    assert comp.missing == {"before": ["extra"], "after": ["fc2"]}
    assert comp.value(ns, "fc1", "after") == after.layer("fc1").value
    assert comp.total(ns, "before") == before.normalized_sharpness
    assert before.compare(after, labels=["before", "after"]).rows == rows


def test_text_table(pair):
    before, after = pair
    text = str(normflat.compare_reports({"before": before, "after": after}))
    lines = text.splitlines()
    assert lines[0] == "normflat comparison of 2 reports: before, after"
    assert "norm. sharpness" in lines[1] and "Hessian trace" in lines[1]
    assert lines[2].split() == ["layer", "kind", "shape"] + ["before", "after", "after/before"] * 2
    fc2 = next(line for line in lines if line.startswith("fc2"))
    assert fc2.split()[4] == "missing"
    fc1 = next(line for line in lines if line.startswith("fc1")).split()
    ratio = after.layer("fc1").value / before.layer("fc1").value
    assert fc1[3:6] == [f"{before.layer('fc1').value:.6g}", f"{after.layer('fc1').value:.6g}", f"{ratio:.6g}"]
    total = next(line for line in lines if line.startswith("total")).split()
    assert total[1] == f"{before.normalized_sharpness:.6g}"
    assert "matched by name" in lines[-1]
    html = normflat.compare_reports([before, after])._repr_html_()
    assert html.count("<tr>") == 2 + 5 and "missing" in html and "report 2/report 1" in html


def test_three_reports_and_options(pair, tmp_path):
    before, after = pair
    third = make(["fc1", "fc2", "out"], 2)
    comp = normflat.compare_reports([before, after, third], measures=normflat.MEASURES)
    assert comp.labels == ("report 1", "report 2", "report 3")
    text = str(comp)
    assert "/" not in text.splitlines()[2]  # a ratio only for two reports
    assert all(m in comp.rows[0] for m in normflat.MEASURES)
    # Paths are read with load_report and labelled by file name.
    before.to_json(tmp_path / "ckpt-a.json")
    after.to_json(tmp_path / "ckpt-b.json")
    from_files = normflat.compare_reports([tmp_path / "ckpt-a.json", str(tmp_path / "ckpt-b.json")])
    assert from_files.labels == ("ckpt-a", "ckpt-b")
    assert from_files.rows == normflat.compare_reports([before, after], labels=["ckpt-a", "ckpt-b"]).rows


def test_bad_arguments(pair):
    before, after = pair
    with pytest.raises(ValueError, match="at least one"):
        normflat.compare_reports([])
    with pytest.raises(ValueError, match="2 labels for 3 reports"):
        normflat.compare_reports([before, after, before], labels=["a", "b"])
    with pytest.raises(ValueError, match="unique"):
        normflat.compare_reports([before, after], labels=["a", "a"])
    with pytest.raises(ValueError, match="Unknown measures"):
        normflat.compare_reports([before, after], measures=["sharpness"])
    with pytest.raises(TypeError, match="item 1 is a dict"):
        normflat.compare_reports([before, {}])
    dup = normflat.Report(layers=[before.layers[0], before.layers[0]])
    with pytest.raises(ValueError, match="repeated layer names"):
        normflat.compare_reports([before, dup])


def test_dataframe(pair):
    from tests.builders import require_frameworks

    require_frameworks("pandas")
    before, after = pair
    df = normflat.compare_reports([before, after], labels=["before", "after"]).to_dataframe()
    assert list(df.index) == ["fc1", "fc2", "out", "extra", "total"]
    assert df.loc["out", ("normalized_sharpness", "after")] == after.layer("out").value
    assert math.isnan(df.loc["fc2", ("hessian_trace", "after")])
    assert df.loc["total", ("hessian_trace", "before")] == before.hessian_trace
    assert df.loc["fc1", ("kind", "")] == "dense"


def test_figure(pair, tmp_path):
    from tests.builders import require_frameworks

    require_frameworks("matplotlib")
    before, after = pair
    comp = normflat.compare_reports([before, after], labels=["before", "after"])
    fig = comp.plot(path=tmp_path / "cmp.png", title="fine-tuning")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax, ax_total = fig.axes[:2]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    # Bars of "before" at fc1, fc2, out (no extra); of "after" at fc1, out, extra.
    np.testing.assert_array_equal(bars["before"], [before.layer(n).value for n in ("fc1", "fc2", "out")])
    np.testing.assert_array_equal(bars["after"], [after.layer(n).value for n in ("fc1", "out", "extra")])
    assert [t.get_text() for t in ax.texts] == ["missing", "missing"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fc1", "fc2", "out", "extra"]
    np.testing.assert_array_equal([p.get_height() for p in ax_total.patches],
                                  [before.normalized_sharpness, after.normalized_sharpness])
    fig2 = comp.plot("hessian_trace")
    assert "Hessian trace" in fig2.axes[0].get_ylabel()
    with pytest.raises(ValueError, match="Unknown measure"):
        comp.plot("nope")
