"""Reports read back from JSON exactly: schema, tagged non-finite numbers, legacy files."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

import normflat
from normflat.core.report import SCHEMA, LayerResult, Report


def degenerate_report(metadata=None) -> Report:
    """Degenerate rows and columns, a grouped convolution, group estimates, odd metadata."""
    rng = np.random.default_rng(3)
    W = rng.normal(size=(5, 4))
    S = rng.random((4, 5, 4)) + 0.1
    S[:, 1] = 0.0                                # zero curvature row -> sigma inf
    S[:, :, 2] = 0.0                             # zero curvature column
    conv_w = rng.normal(size=(6, 2, 3, 3))
    conv_w[4] = 0.0                              # zero weight row -> sigma 0
    conv_s = rng.random((4, 6, 2, 3, 3))
    problems = [
        normflat.LayerProblem("fc", W, S.mean(axis=0), hessian_diag_samples=S, details={"path": "fast"}),
        normflat.LayerProblem("grouped", conv_w, conv_s.mean(axis=0), kind="conv2d",
                              groups=3, hessian_diag_samples=conv_s,
                              details={"shape": (6, 2, 3, 3), "ratio": math.inf}),
    ]
    report = normflat.analyze(problems)
    report.metadata.update(metadata if metadata is not None else {
        "framework": "torch", "samples": 4, "seed": None, "note": "inf", "dtype": "float64",
        "nan": math.nan, "neg": -math.inf, "tuple": (1, (2.5, "x")), "list": [1, None, True],
        "nested": {"$ref": 1, "k": [math.inf]}, "array": np.arange(6.0).reshape(2, 3), "flag": False,
        "one": 1, "one_float": 1.0,
    })
    return report


def test_exact_round_trip_of_everything(tmp_path):
    report = degenerate_report()
    fc, grouped = report.layer("fc"), report.layer("grouped")
    # The fixture has what the format must keep apart.
    assert np.isinf(fc.row_sigma).any() and (grouped.row_sigma == 0).any()
    assert fc.degenerate_rows and fc.degenerate_cols and grouped.degenerate_rows and fc.standard_error
    assert report.layer("grouped").col_sigma.size == 6 and report.standard_error is not None

    path = tmp_path / "r.json"
    text = report.to_json(path)
    for loaded in (Report.from_json(path), Report.from_json(str(path)), Report.from_json(text),
                   normflat.load_report(path), Report.from_dict(json.loads(text)),
                   Report.from_dict(report.to_dict())):
        assert loaded == report
        assert loaded.standard_error == report.standard_error  # totals' errors from group values
        assert loaded.totals == report.totals
        assert loaded.to_json() == text
    loaded = normflat.load_report(path)
    assert loaded.metadata["tuple"] == (1, (2.5, "x")) and isinstance(loaded.metadata["tuple"][1], tuple)
    assert loaded.metadata["note"] == "inf" and math.isinf(loaded.metadata["neg"]) and loaded.metadata["neg"] < 0
    assert math.isnan(loaded.metadata["nan"]) and loaded.metadata["nested"] == {"$ref": 1, "k": [math.inf]}
    assert loaded.metadata["array"].dtype == np.float64 and loaded.metadata["array"].shape == (2, 3)
    assert loaded.layer("grouped").details == {"shape": (6, 2, 3, 3), "ratio": math.inf}
    lf = loaded.layer("fc")
    assert lf.row_sigma.dtype == np.float64 and isinstance(lf.shape, tuple)
    assert isinstance(lf.degenerate_rows, tuple) and lf.degenerate_rows == fc.degenerate_rows
    np.testing.assert_array_equal(lf.sigma, fc.sigma)
    assert LayerResult.from_dict(fc.to_dict()) == fc


def test_json_is_strict_and_infinity_is_not_nan():
    report = degenerate_report()
    text = report.to_json()

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(text, parse_constant=refuse)
    assert data["schema"] == SCHEMA
    fc, grouped = data["layers"]
    assert "inf" in fc["row_sigma"] and 0.0 in grouped["row_sigma"] and None not in fc["row_sigma"]
    assert data["metadata"]["nan"] == {"$float": "nan"} and data["metadata"]["note"] == "inf"
    # A NaN sigma (never produced by the solver) stays a NaN, not an infinity.
    layer = report.layers[0]
    object.__setattr__(layer, "row_sigma", np.array([math.nan, math.inf, 0.0, 1.0, -math.inf]))
    again = Report.from_json(report.to_json()).layers[0].row_sigma
    assert math.isnan(again[0]) and again[1] == math.inf and again[4] == -math.inf and again[2] == 0.0


def test_equality_sees_every_difference():
    report = degenerate_report()
    same = Report.from_json(report.to_json())
    assert same == report and not (same != report)
    layer = same.layers[0]
    changed = Report(layers=[LayerResult(**{**{f: getattr(layer, f) for f in layer.__dataclass_fields__},
                                            "row_sigma": layer.row_sigma * 1.0000001}), same.layers[1]],
                     metadata=same.metadata)
    assert changed != report
    assert Report(layers=same.layers, metadata={**same.metadata, "tuple": [1, [2.5, "x"]]}) != report
    assert Report(layers=same.layers, metadata={**same.metadata, "flag": 0}) != report
    assert Report(layers=same.layers[:1], metadata=same.metadata) != report


def test_plain_reports_without_estimates_or_metadata():
    rng = np.random.default_rng(0)
    report = normflat.analyze([normflat.LayerProblem("a", rng.normal(size=(3, 2)), rng.random((3, 2)))])
    loaded = Report.from_json(report.to_json())
    assert loaded == report and loaded.standard_error is None and loaded.layers[0]._group_values is None


def test_reads_the_unversioned_format():
    # Files written before the schema: no "schema" key, null for an infinite sigma,
    # metadata as plain JSON, no group values.
    report = degenerate_report(metadata={"framework": "keras", "examples": 30})
    data = json.loads(report.to_json())
    legacy = copy.deepcopy(data)
    del legacy["schema"]
    for layer in legacy["layers"]:
        del layer["group_values"]
        layer["row_sigma"] = [None if v == "inf" else v for v in layer["row_sigma"]]
        layer["col_sigma"] = [None if v == "inf" else v for v in layer["col_sigma"]]
    legacy["layers"][1]["details"] = {"shape": [6, 2, 3, 3], "ratio": None}
    loaded = Report.from_dict(json.loads(json.dumps(legacy)))
    for old, new in zip(report.layers, loaded.layers):
        np.testing.assert_array_equal(new.row_sigma, old.row_sigma)  # null read as inf
        np.testing.assert_array_equal(new.col_sigma, old.col_sigma)
        assert new.normalized_sharpness == old.normalized_sharpness
        assert new.standard_error == old.standard_error
    assert loaded.metadata == {"framework": "keras", "examples": 30}
    assert loaded.layers[1].details == {"shape": [6, 2, 3, 3], "ratio": None}
    assert loaded.standard_error is None  # no group values in that format


@pytest.mark.parametrize("schema, message", [
    ("normflat.report/2", "newer normflat"),
    ("normflat.report/99", "Upgrade normflat"),
    ("something.else/1", "Not a normflat report"),
    ("normflat.report/0", "Unknown report schema"),
])
def test_unknown_schema_is_refused(schema, message):
    data = degenerate_report().to_dict()
    data["schema"] = schema
    with pytest.raises(ValueError, match=message):
        Report.from_dict(data)
    with pytest.raises(ValueError, match=message):
        Report.from_json(json.dumps(data))


def test_malformed_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a 'schema' nor a 'layers'"):
        Report.from_dict({"results": []})
    with pytest.raises(ValueError, match="JSON object"):
        Report.from_dict([1, 2])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        normflat.load_report(bad)
    with pytest.raises(FileNotFoundError):
        normflat.load_report(tmp_path / "none.json")
    data = degenerate_report().to_dict()
    del data["layers"][0]["row_sigma"]
    with pytest.raises(ValueError, match="layer 0 .'fc'. lacks row_sigma"):
        Report.from_dict(data)
    data = degenerate_report().to_dict()
    data["layers"][1]["imbalance"] = "Infinity"
    with pytest.raises(ValueError, match="imbalance must be a number"):
        Report.from_dict(data)
    data = degenerate_report().to_dict()
    data["metadata"]["x"] = {"$weird": 1}
    with pytest.raises(ValueError, match="Unknown tagged value"):
        Report.from_dict(data)
