"""Report serialization, display and standard errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import normflat


@pytest.fixture
def report():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(4, 3))
    H = rng.random((4, 3))
    H[1] = 0.0  # a degenerate row -> infinite sigma in the JSON
    problems = [
        normflat.LayerProblem("fc1", W, H),
        normflat.LayerProblem("conv", rng.normal(size=(2, 3, 2, 2)), rng.normal(size=(2, 3, 2, 2)), kind="conv2d",
                              details={"path": "fast"}),
    ]
    return normflat.analyze(problems)


def test_to_dict_and_json_round_trip(report, tmp_path):
    path = tmp_path / "r.json"
    text = report.to_json(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(text)
    assert loaded["totals"]["normalized_sharpness"] == pytest.approx(report.normalized_sharpness, rel=1e-15)
    fc1 = loaded["layers"][0]
    assert fc1["name"] == "fc1" and fc1["shape"] == [4, 3]
    assert fc1["row_sigma"][1] == "inf"  # optimum at infinity, a tagged string (strict JSON)
    assert loaded["schema"] == "normflat.report/1"
    assert fc1["degenerate_rows"] == [1]
    assert loaded["layers"][1]["details"] == {"path": "fast"}
    for key in ("iterations", "imbalance", "converged", "clipped", "col_sigma", "standard_error"):
        assert key in fc1
    assert "Infinity" not in text and "NaN" not in text


def test_dataframe(report):
    df = report.to_dataframe()
    assert list(df.index) == ["fc1", "conv"]
    assert df.loc["conv", "hessian_trace"] == pytest.approx(report.layer("conv").hessian_trace)
    assert df["normalized_sharpness"].sum() == pytest.approx(report.normalized_sharpness)


def test_dataframe_without_pandas(report, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError("No module named 'pandas'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install pandas"):
        report.to_dataframe()


def test_text_and_html_tables(report):
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("normflat report")
    assert any(line.startswith("fc1") for line in lines)
    assert any(line.startswith("total") and f"{report.normalized_sharpness:.6g}" in line for line in lines)
    html = report._repr_html_()
    assert html.count("<tr>") == 1 + 2 + 1  # header, layers, total
    assert "conv2d" in html
    assert "normalized_sharpness=" in repr(report)


def test_sigma_property(report):
    layer = report.layer("conv")
    np.testing.assert_allclose(layer.sigma**2, np.outer(layer.row_sigma, layer.col_sigma))


def test_standard_errors_from_group_estimates():
    rng = np.random.default_rng(1)
    W = rng.normal(size=(3, 4))
    groups = rng.random((5, 3, 4)) + 0.5
    H = groups.mean(axis=0)
    p = normflat.LayerProblem("fc", W, H, hessian_diag_samples=groups)
    q = normflat.LayerProblem("fc2", W[:2], H[:2], hessian_diag_samples=groups[:, :2])
    report = normflat.analyze([p, q])
    layer = report.layer("fc")
    traces = groups.reshape(5, -1).sum(axis=1)
    assert layer.standard_error["hessian_trace"] == pytest.approx(np.std(traces, ddof=1) / math.sqrt(5), rel=1e-12)
    # Delta method: a first-order expansion of NS around H. Check against finite
    # evaluation: the NS of each group estimate minus the mean is close to linear.
    exact_group_ns = np.array([normflat.normalized_sharpness(W, g).value for g in groups])
    lin = layer._group_values["normalized_sharpness"]
    np.testing.assert_allclose(lin, exact_group_ns, rtol=0.05)
    # Totals: per-group sums over layers, then the spread.
    both = traces + groups[:, :2].reshape(5, -1).sum(axis=1)
    assert report.standard_error["hessian_trace"] == pytest.approx(np.std(both, ddof=1) / math.sqrt(5), rel=1e-12)
    assert "± std. error" in str(report)


def test_no_standard_error_without_samples(report):
    assert report.standard_error is None
    assert report.layers[0].standard_error is None


def test_identical_group_estimates_have_zero_error():
    W = np.ones((2, 2))
    H = np.full((2, 2), 2.0)
    report = normflat.analyze([normflat.LayerProblem("a", W, H, hessian_diag_samples=np.stack([H, H, H]))])
    assert all(v == pytest.approx(0.0, abs=1e-15) for v in report.standard_error.values())
