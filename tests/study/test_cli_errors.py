"""Every wrong input to the command line is one line ``normflat: error: ...`` and exit status 2,
and output folders never mix two runs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch", "matplotlib", "normflat.backends.torch")

import torch  # noqa: E402

import normflat.study.run as study_run  # noqa: E402
from normflat.cli import main  # noqa: E402
from normflat.study.models import build_model  # noqa: E402
from normflat.study.outputs import MANIFEST  # noqa: E402
from tests.study._cli import assert_one_line_error, run_cli  # noqa: E402

TINY = ["--quick", "--train-size", "120", "--test-size", "80", "--epochs", "2", "--no-progress", "--rivals", "none"]
TRUST = ["--trust-pickle"]  # m.pt is a whole pickled module: loading it runs code from the file


@pytest.fixture
def files(tmp_path):
    model = build_model("mlp", (1, 8, 8), 10, width=4, seed=0)
    torch.save(model, tmp_path / "m.pt")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    np.savez(tmp_path / "good.npz", x=np.zeros((6, 1, 8, 8), dtype="float32"), y=np.arange(6))
    np.savez(tmp_path / "shape.npz", x=np.zeros((6, 3)), y=np.zeros(6, dtype=int))
    np.savez(tmp_path / "labels.npz", x=np.zeros((6, 1, 8, 8)), y=np.full(6, 12))
    np.savez(tmp_path / "neg.npz", x=np.zeros((6, 1, 8, 8)), y=np.full(6, -1))
    np.savez(tmp_path / "floaty.npz", x=np.zeros((6, 1, 8, 8)), y=np.zeros(6))
    np.savez(tmp_path / "short.npz", x=np.zeros((5, 1, 8, 8)), y=np.zeros(6, dtype=int))
    np.savez(tmp_path / "keys.npz", inputs=np.zeros((6, 3)))
    np.savez(tmp_path / "object.npz", x=np.array([None] * 6, dtype=object), y=np.zeros(6, dtype=int))
    np.save(tmp_path / "array.npy", np.zeros((6, 3)))
    (tmp_path / "text.npz").write_text("not an archive\n")
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "truncated.npz").write_bytes((tmp_path / "good.npz").read_bytes()[:60])
    (tmp_path / "corrupt.keras").write_text("garbage")
    (tmp_path / "bad.pt").write_text("hello")
    (tmp_path / "model.onnx").write_text("x")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "plainfile").write_text("x")
    return tmp_path


@pytest.mark.parametrize("model, data, extra, fragments", [
    ("m.pt", "shape.npz", TRUST, ["cannot take x", "shape (6, 3)", "layout the model expects"]),
    ("m.pt", "labels.npz", TRUST, ["labels up to 12", "outputs 10 classes"]),
    ("m.pt", "neg.npz", TRUST, ["negative labels"]),
    ("m.pt", "floaty.npz", TRUST, ["integer class labels"]),
    ("m.pt", "short.npz", TRUST, ["one row per label"]),
    ("m.pt", "keys.npz", TRUST, ["arrays named 'x' and 'y'", "numpy.savez"]),
    ("m.pt", "object.npz", TRUST, ["object (pickled) arrays", "numeric arrays"]),
    ("m.pt", "array.npy", TRUST, ["is an .npy file", "numpy.savez"]),
    ("m.pt", "text.npz", TRUST, ["is not an .npz file", "not a zip archive"]),
    ("m.pt", "empty.npz", TRUST, ["is not an .npz file", "is empty"]),
    ("m.pt", "truncated.npz", TRUST, ["Cannot read", "truncated or corrupted"]),
    ("m.pt", "missing.npz", TRUST, ["does not exist"]),
    ("m.pt", "folder.npz", TRUST, ["is a folder", "lacks x.npy and y.npy", ".npz file"]),
    ("m.pt", "good.npz", [], ["runs code from the file", "--trust-pickle", "state_dict"]),
    ("corrupt.keras", "good.npz", [], ["not a valid .keras file", "model.save"]),
    ("corrupt.keras", "good.npz", ["--model", "mymodels:make"], ["holds its architecture", "drop the model factory"]),
    ("bad.pt", "good.npz", [], ["Cannot load", "truncated, corrupted", "torch.save(model, path)"]),
    ("bad.pt", "good.npz", TRUST, ["Cannot load", "torch.save(model, path)"]),
    ("sd.pt", "good.npz", [], ["holds a state_dict", "--model module:function"]),
    ("sd.pt", "good.npz", ["--model", "no_such_module:make"], ["Cannot import the factory module", "PYTHONPATH"]),
    ("sd.pt", "good.npz", ["--model", "make_net"], ["must be 'module:function'"]),
    ("weights.safetensors", "good.npz", [], ["holds weights only", "--model module:function"]),
    ("model.onnx", "good.npz", [], ["Unknown checkpoint type '.onnx'", ".keras", "save the model"]),
    ("missing.pt", "good.npz", [], ["does not exist"]),
    ("folder.npz", "good.npz", [], ["is a folder", "model file"]),
    ("m.pt", "good.npz", [*TRUST, "--framework", "keras"], ["loaded as a torch model", "--framework keras"]),
    ("m.pt", "good.npz", [*TRUST, "--json", "folder.npz"], ["--json", "is a folder"]),
    ("m.pt", "good.npz", [*TRUST, "--json", "nowhere/r.json"], ["folder", "does not exist"]),
    ("m.pt", "good.npz", [*TRUST, "--plot", "figure.npz"], ["cannot write .npz files", ".png"]),
    ("m.pt", "good.npz", [*TRUST, "--plot", "plainfile/x.png"], ["--plot", "does not exist"]),
])
def test_analyze_bad_inputs(files, capsys, monkeypatch, model, data, extra, fragments):
    monkeypatch.chdir(files)
    before = sorted(os.listdir(files))
    code, _, err = run_cli(["analyze", model, "--data", data, "--no-progress", *extra], capsys)
    assert_one_line_error(code, err, *fragments)
    assert sorted(os.listdir(files)) == before  # nothing written on an error


def test_out_pointing_at_a_file(files, capsys):
    for argv in (["study", *TINY, "--out", str(files / "plainfile")],
                 ["study", *TINY, "--out", str(files / "plainfile" / "sub")],
                 ["invariance", "--quick", "--no-progress", "--out", str(files / "plainfile")],
                 ["compare", str(files / "m.pt"), "--trust-pickle", "--train", str(files / "good.npz"),
                  "--test", str(files / "good.npz"), "--out", str(files / "plainfile")]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, "plainfile", "is a file")
    assert (files / "plainfile").read_text() == "x"


@pytest.mark.parametrize("argv, fragments", [
    (["m.pt", "--trust-pickle", "--train", "shape.npz", "--test", "good.npz"], ["cannot take x", "shape.npz"]),
    (["m.pt", "--trust-pickle", "--train", "good.npz", "--test", "labels.npz"], ["labels up to 12"]),
    (["m.pt", "--trust-pickle", "--train", "good.npz", "--test", "array.npy"], ["is an .npy file"]),
    (["m.pt", "--train", "good.npz", "--test", "good.npz"], ["--trust-pickle"]),
    (["sd.pt", "--train", "good.npz", "--test", "good.npz"], ["holds a state_dict", "--model"]),
    (["nothing/*.pt", "--train", "good.npz", "--test", "good.npz"], ["No checkpoint matches"]),
    (["folder.npz", "--train", "good.npz", "--test", "good.npz"], ["holds no checkpoint"]),
])
def test_compare_bad_inputs(files, capsys, monkeypatch, argv, fragments):
    monkeypatch.chdir(files)
    before = sorted(os.listdir(files))
    code, _, err = run_cli(["compare", *argv, "--no-progress", "--out", "cmp"], capsys)
    assert_one_line_error(code, err, *fragments)
    assert sorted(os.listdir(files)) == before  # no output folder on an error


def test_invariance_bad_model_input(files, capsys):
    code, _, err = run_cli(["invariance", "--model", str(files / "m.pt"), "--data", str(files / "shape.npz"),
                         "--trust-pickle", "--no-progress", "--out", str(files / "inv")], capsys)
    assert_one_line_error(code, err, "cannot take x")
    code, _, err = run_cli(["invariance", "--model", str(files / "m.pt"), "--data", str(files / "good.npz"),
                         "--no-progress", "--out", str(files / "inv")], capsys)
    assert_one_line_error(code, err, "--trust-pickle")
    assert not (files / "inv").exists()


def test_argparse_errors_are_one_line(capsys):
    for argv, fragment in ((["study", "--ratios", "a,b"], "comma-separated numbers"),
                           (["study", "--bogus"], "unrecognized arguments"),
                           (["analyze", "m.pt"], "--data"),
                           (["compare", "m.pt", "--train", "t.npz"], "--test"),
                           (["analyze", "m.pt", "--data", "d.npz", "--framework", "mxnet"], "invalid choice"),
                           (["nosuchcommand"], "invalid choice")):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, fragment, "--help")


def test_debug_shows_the_traceback(files, capsys):
    from normflat.cli import CLIError

    argv = ["analyze", str(files / "m.pt"), "--trust-pickle", "--data", str(files / "array.npy")]
    with pytest.raises(CLIError, match="is an .npy file"):
        main(["--debug", *argv])
    with pytest.raises(CLIError):
        main([*argv, "--debug"])


def test_a_bug_is_not_hidden(files, capsys, monkeypatch):
    # An error that is not the user's (here a RuntimeError from the analysis) keeps its traceback.
    import normflat

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(normflat, "analyze", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["analyze", str(files / "m.pt"), "--trust-pickle", "--data", str(files / "good.npz"), "--no-progress"])


def _folder(out):
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def test_rerunning_a_study_replaces_the_previous_run(tmp_path, capsys):
    out = tmp_path / "study"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # not normflat's: left alone
    assert main(["study", *TINY, "--ratios", "0,0.5,1", "--out", str(out)]) == 0
    three = _folder(out)
    assert "reports/run002_rescaled.json" in three and "notes.txt" in three
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(f for f in three if f not in ("notes.txt", MANIFEST))

    assert main(["study", *TINY, "--ratios", "0", "--no-reparam", "--out", str(out)]) == 0
    one = _folder(out)
    assert [f for f in one if f.startswith("reports/")] == ["reports/run000.json"]
    assert "notes.txt" in one and not any(".normflat-partial" in f for f in one)
    result = study_run.load_result(out / "results.json")
    assert len(result.rows) == 1 and result.files["csv"] == str(out / "results.csv")
    assert sorted(json.loads((out / MANIFEST).read_text())["files"]) == sorted(
        f for f in one if f not in ("notes.txt", MANIFEST))


def test_a_folder_from_before_manifests_is_replaced_too(tmp_path):
    out = tmp_path / "old"
    (out / "reports").mkdir(parents=True)
    for name in ("results.csv", "results.json", "layers.png", "reports/run001.json",
                 "reports/run001_rescaled.json", "reports/keep.txt", "other.csv"):
        (out / name).write_text("old")
    assert main(["study", *TINY, "--ratios", "0", "--no-reparam", "--out", str(out)]) == 0
    files = _folder(out)
    assert "reports/run001.json" not in files and "reports/run001_rescaled.json" not in files
    assert "reports/keep.txt" in files and "other.csv" in files  # not names a study writes
    assert (out / "results.csv").read_text() != "old"


def test_a_failed_run_leaves_the_previous_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "study"
    assert main(["study", *TINY, "--ratios", "0,1", "--no-reparam", "--out", str(out)]) == 0
    before = {f: (out / f).read_bytes() for f in _folder(out)}
    calls = []
    real = study_run._analyze

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(study_run, "_analyze", fail_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        main(["study", *TINY, "--ratios", "0,0.5,1", "--no-reparam", "--out", str(out)])
    assert {f: (out / f).read_bytes() for f in _folder(out)} == before
    assert not list(out.glob(".normflat-partial*"))


def test_invariance_rerun_replaces_its_files(tmp_path, monkeypatch):
    from normflat.study.invariance import write_invariance

    from normflat.core.constants import MEASURES

    rows = [{"orders": r, **{f"{m}_ratio": 1.0 for m in MEASURES}} for r in (0.0, 1.0)]
    out = tmp_path / "inv"
    write_invariance(rows, out, {"run": 1})
    assert (out / "invariance.png").is_file()
    # Without matplotlib the next run writes no figure: the old one must not stay.
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    files = write_invariance(rows, out, {"run": 2})
    assert "figure" not in files and not (out / "invariance.png").exists()
    assert json.loads((out / "invariance.json").read_text())["meta"] == {"run": 2}


def test_the_main_job_writes_only_under_out(tmp_path, monkeypatch):
    # `bash scripts/main --quick --out DIR` runs `python -m normflat study --quick --out DIR`:
    # the same code path, from an empty working directory, must leave that directory empty.
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["study", "--quick", "--no-progress", "--out", str(out)]) == 0
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "out"]
    assert {"results.csv", "results.json", MANIFEST, "gap_vs_measures.png", "layers.png"} <= set(_folder(out))
