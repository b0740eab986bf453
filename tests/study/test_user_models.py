"""``normflat study`` on a model family and a dataset of the user's (torch), the width axis,
devices, precisions and the errors of each new input."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch", "normflat.backends.torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import normflat  # noqa: E402
from normflat.core.constants import MEASURES  # noqa: E402
from normflat.study.datasets import Dataset, StudyInputError, load_dataset  # noqa: E402
from normflat.study.run import HYPERPARAMETERS, StudyConfig, format_table, load_result, run_study  # noqa: E402
from normflat.study.training import corrupt_labels, train_model  # noqa: E402
from tests.study._cli import assert_one_line_error, run_cli  # noqa: E402

FAST = ["--ratios", "0,1", "--seeds", "1", "--epochs", "3", "--no-progress"]

FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn

    def mlp(input_shape, num_classes, width=None, seed=0):
        hidden = width or 5
        return nn.Sequential(nn.Linear(input_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    class Residual(nn.Module):
        """The ReLU output feeds the next layer and the sum: no exact unit-wise symmetry."""

        def __init__(self, d, h, c):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, c)

        def forward(self, x):
            z = torch.relu(self.a(x))
            return self.c(z + torch.relu(self.b(z)))

    def residual(input_shape, num_classes, width=None, seed=0):
        return Residual(input_shape[0], width or 5, num_classes)

    def no_args():
        return nn.Linear(2, 2)

    def not_a_module(input_shape, num_classes, width=None, seed=0):
        return "a string"

    def wrong_outputs(input_shape, num_classes, width=None, seed=0):
        return nn.Linear(input_shape[0], num_classes + 1)

    def broken(input_shape, num_classes, width=None, seed=0):
        raise RuntimeError("out of coffee")

    _CACHED = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))

    def cached(input_shape, num_classes, width=None, seed=0):
        return _CACHED

    def tuple_data(data_dir=None):
        rng = __import__("numpy").random.default_rng(1)
        return (rng.normal(size=(30, 6)).astype("float32"), rng.integers(0, 3, 30),
                rng.normal(size=(20, 6)).astype("float32"), rng.integers(0, 3, 20))

    SEEN = []

    def wrong_type(data_dir=None):
        return [1, 2]

    def dict_data(data_dir=None):
        SEEN.append(data_dir)
        x = tuple_data()
        return {"x_train": x[0], "y_train": x[1], "x_test": x[2], "y_test": x[3], "num_classes": 4}
''')


def features(seed=0, n_train=40, n_test=30, d=6, classes=3):
    """Random real-valued features: inputs that are not images, so nothing may reshape them."""
    rng = np.random.default_rng(seed)
    return {"x_train": rng.normal(size=(n_train, d)).astype(np.float32), "y_train": rng.integers(0, classes, n_train),
            "x_test": rng.normal(size=(n_test, d)).astype(np.float32), "y_test": rng.integers(0, classes, n_test)}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder with the factories module, a feature .npz and broken variants; the current directory."""
    (tmp_path / "usermodels.py").write_text(FACTORIES)
    arrays = features()
    np.savez(tmp_path / "feat.npz", **arrays)
    np.savez(tmp_path / "missing.npz", **{k: v for k, v in arrays.items() if k != "x_test"})
    np.savez(tmp_path / "short.npz", **{**arrays, "y_train": arrays["y_train"][:-1]})
    np.savez(tmp_path / "range.npz", **arrays, num_classes=2)
    np.savez(tmp_path / "floaty.npz", **{**arrays, "y_test": arrays["y_test"] + 0.5})
    np.savez(tmp_path / "shapes.npz", **{**arrays, "x_test": arrays["x_test"][:, :4]})
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermodels", raising=False)  # this test's copy, not another's
    return tmp_path


def test_user_factory_and_npz_end_to_end_with_a_width_axis(work, capsys):
    code, printed, err = run_cli(["study", "--model", "usermodels:mlp", "--dataset", "feat.npz", "--width", "3,default",
                                  *FAST, "--out", "out"], capsys)
    assert code == 0, err
    result = load_result(work / "out" / "results.json")
    assert result.config["model"] == "usermodels:mlp" and result.config["arch"] is None
    assert result.config["widths"] == [3, None] and "width" not in result.config
    assert (result.config["device"], result.config["precision"], result.config["analysis_dtype"]) == (
        "auto", "float32", "float64")
    assert result.environment["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # seeds x widths x ratios, in that order
    assert [(r["seed"], r["width"], r["ratio"]) for r in result.rows] == [(0, 3, 0.0), (0, 3, 1.0), (0, None, 0.0),
                                                                          (0, None, 1.0)]
    assert result.statistics["psi"]["axes"] == ["ratio", "width"]
    assert set(result.correlations["trained"]["hessian_trace"]["psi_per_axis"]) == {"ratio", "width"}
    assert "usermodels:mlp" in printed and "over the axes ratio, width" in printed
    layers = json.loads((work / "out" / "reports" / "run000.json").read_text())["layers"]
    assert [layer["shape"] for layer in layers] == [[3, 6], [3, 3]]  # width 3 reached the factory
    for r in result.rows:
        assert r["rescale_function_error"] < 1e-12
        assert r["rescaled_normalized_sharpness"] == pytest.approx(r["normalized_sharpness"], rel=1e-10)
        assert abs(math.log10(r["rescaled_hessian_trace"] / r["hessian_trace"])) > 0.1

    # Brute-force reference for the second row (width default, ratio 1): build, train and
    # analyze the same model by hand; the study must have done exactly this.
    data = load_dataset("feat.npz")
    y_noisy = torch.as_tensor(corrupt_labels(data.y_train, 1.0, data.num_classes, 1000))
    import usermodels

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = usermodels.mlp(input_shape=(6,), num_classes=3, width=None, seed=0)
    x = torch.as_tensor(data.x_train)
    train_model(model, x, y_noisy, epochs=3, lr=1e-3, batch_size=64, optimizer="adam", seed=0, progress=False)
    report = normflat.analyze(model.double().eval(), [(x.double(), y_noisy)], progress=False)
    for m in MEASURES:
        assert result.rows[3][m] == pytest.approx(getattr(report, m), rel=1e-10), m


def test_a_callable_factory_gets_its_arguments_and_the_inputs_as_they_are(tmp_path):
    calls, shapes = [], []

    def factory(input_shape, num_classes, width, seed):
        calls.append((input_shape, num_classes, width, seed, torch.initial_seed()))
        model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 3, width or 7), nn.ReLU(), nn.Linear(width or 7, 4))
        model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape[1:])))
        return model

    rng = np.random.default_rng(0)
    data = Dataset("mine", rng.random((24, 2, 5, 3), dtype=np.float32), rng.integers(0, 4, 24),
                   rng.random((10, 2, 5, 3), dtype=np.float32), rng.integers(0, 4, 10), 4, "test", None)
    state = torch.random.get_rng_state()
    result = run_study(StudyConfig(dataset=lambda: data, model=factory, widths=(None, 4), seeds=(0, 2),
                                   ratios=(0.0,), epochs=1, progress=False, out=str(tmp_path / "o")), echo=None)
    assert torch.equal(torch.random.get_rng_state(), state)  # the study forked torch's generator
    # One call per model, plus one per width for the rescaling check before training.
    assert [c[:4] for c in calls] == [((2, 5, 3), 4, None, 0), ((2, 5, 3), 4, 4, 0), ((2, 5, 3), 4, None, 0),
                                      ((2, 5, 3), 4, 4, 0), ((2, 5, 3), 4, None, 2), ((2, 5, 3), 4, 4, 2)]
    assert [c[4] for c in calls] == [0, 0, 0, 0, 2, 2]  # torch seeded with the model's seed
    assert set(shapes) == {(2, 5, 3)}  # NCHW-like user inputs untouched
    assert result.config["model"].endswith("factory") and result.config["dataset"].endswith("<lambda>")
    json.dumps(result.to_dict())  # callables are recorded by name


def test_module_function_datasets(work, capsys):
    code, _, err = run_cli(["study", "--model", "usermodels:mlp", "--dataset", "usermodels:tuple_data", *FAST,
                            "--no-reparam", "--out", "o1"], capsys)
    assert code == 0, err
    result = load_result(work / "o1" / "results.json")
    assert len(result.rows) == 2 and result.config["dataset"] == "usermodels:tuple_data"
    import usermodels

    data = load_dataset("usermodels:dict_data", "some/dir")
    assert usermodels.SEEN[-1] == "some/dir" and data.num_classes == 4 and data.image_layout is None
    np.testing.assert_array_equal(data.x_train, usermodels.tuple_data()[0])
    assert load_dataset("usermodels:tuple_data", train_size=10).y_train.shape == (10,)
    assert load_dataset(str(work / "usermodels.py") + ":tuple_data").num_classes == int(
        max(usermodels.tuple_data()[1].max(), usermodels.tuple_data()[3].max())) + 1


def test_a_model_the_rescaler_cannot_handle_fails_before_training(work, capsys, monkeypatch):
    import normflat.study.frameworks as frameworks

    def never(*args, **kwargs):
        raise AssertionError("trained before the rescaling check")

    with monkeypatch.context() as patch:
        patch.setattr(frameworks.TorchAdapter, "train", never)
        code, _, err = run_cli(["study", "--model", "usermodels:residual", "--dataset", "feat.npz", *FAST, "--out",
                                "o"], capsys)
    assert_one_line_error(code, err, "reparametrization arm cannot run", "usermodels:residual", "--no-reparam")
    assert not (work / "o").exists()  # checked before the output folder is touched
    code, _, err = run_cli(["study", "--model", "usermodels:residual", "--dataset", "feat.npz", *FAST, "--no-reparam",
                            "--out", "o"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("argv, fragments", [
    (["--model", "usermodels", "--dataset", "feat.npz"], ["must be 'module:function'"]),
    (["--model", "nosuchmodule:mlp", "--dataset", "feat.npz"], ["cannot import the module 'nosuchmodule'", "PYTHONPATH"]),
    (["--model", "missing.py:mlp", "--dataset", "feat.npz"], ["missing.py does not exist"]),
    (["--model", "usermodels:nothing", "--dataset", "feat.npz"], ["has no 'nothing'", "mlp"]),
    (["--model", "usermodels:no_args", "--dataset", "feat.npz"], ["cannot be called as", "input_shape=..."]),
    (["--model", "usermodels:not_a_module", "--dataset", "feat.npz"], ["not a torch.nn.Module"]),
    (["--model", "usermodels:wrong_outputs", "--dataset", "feat.npz"], ["is (2, 4), not (2, 3)"]),
    (["--model", "usermodels:broken", "--dataset", "feat.npz"], ["failed", "out of coffee"]),
    (["--model", "usermodels:cached", "--dataset", "feat.npz", "--no-reparam"], ["same object twice"]),
    (["--model", "usermodels:mlp", "--arch", "cnn", "--dataset", "feat.npz"], ["not both"]),
    (["--arch", "mlp", "--dataset", "feat.npz"], ["takes images", "--model"]),
    (["--model", "usermodels:mlp", "--dataset", "nothere.npz"], ["nothere.npz does not exist"]),
    (["--model", "usermodels:mlp", "--dataset", "missing.npz"], ["lacks the array(s) x_test", "numpy.savez"]),
    (["--model", "usermodels:mlp", "--dataset", "short.npz"], ["different lengths", "40 inputs, 39 labels"]),
    (["--model", "usermodels:mlp", "--dataset", "range.npz"], ["go up to 2", "num_classes is 2"]),
    (["--model", "usermodels:mlp", "--dataset", "floaty.npz"], ["y_test", "integer class labels"]),
    (["--model", "usermodels:mlp", "--dataset", "shapes.npz"], ["differ in shape"]),
    (["--model", "usermodels:mlp", "--dataset", "usermodels:broken"], ["dataset function usermodels:broken failed"]),
    (["--model", "usermodels:mlp", "--dataset", "usermodels:wrong_type"], ["returned a list", "x_train, y_train"]),
    (["--model", "usermodels:mlp", "--dataset", "feat.npz", "--data-dir", "x"], ["drop --data-dir"]),
    (["--dataset", "cifar"], ["Unknown dataset 'cifar'", "FILE.npz"]),
    (["--width", "0"], ["widths must be positive"]),
    (["--width", "4,4"], ["must not repeat"]),
    (["--device", "tpu"], ["invalid choice"]),
    (["--precision", "float16"], ["invalid choice"]),
])
def test_bad_user_inputs_are_one_line_errors(work, capsys, argv, fragments):
    code, _, err = run_cli(["study", *argv, *FAST, "--out", "o"], capsys)
    assert_one_line_error(code, err, *fragments)
    assert not (work / "o" / "results.json").exists()  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(work, capsys):
    code, _, err = run_cli(["study", "--quick", "--device", "cuda", *FAST, "--out", "o"], capsys)
    assert_one_line_error(code, err, "--device cuda", "finds no CUDA device", "--device cpu")


def test_cpu_device_mixed_precision_and_float32_analysis(work, capsys):
    base = ["study", "--model", "usermodels:mlp", "--dataset", "feat.npz", "--device", "cpu", *FAST]
    assert run_cli([*base, "--out", "f32"], capsys)[0] == 0
    code, _, err = run_cli([*base, "--precision", "mixed", "--analysis-dtype", "float32", "--out", "mixed"], capsys)
    assert code == 0, err
    f32, mixed = load_result(work / "f32" / "results.json"), load_result(work / "mixed" / "results.json")
    assert (mixed.config["device"], mixed.config["precision"], mixed.config["analysis_dtype"]) == (
        "cpu", "mixed", "float32")
    assert mixed.environment["device"] == "cpu"
    report = json.loads((work / "mixed" / "reports" / "run000.json").read_text())
    assert report["metadata"]["dtype"] == "float32"
    for a, b in zip(f32.rows, mixed.rows):
        # bfloat16 autocast changes the training trajectory a little, not the model's size.
        assert b["train_loss"] != a["train_loss"]
        assert b["hessian_trace"] == pytest.approx(a["hessian_trace"], rel=0.2)
        assert b["rescale_function_error"] < 1e-4  # the float32 tolerance
        assert b["rescaled_normalized_sharpness"] == pytest.approx(b["normalized_sharpness"], rel=1e-4)


def test_mixed_precision_training_matches_a_hand_written_autocast_step():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    reference = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    reference.load_state_dict(model.state_dict())
    train_model(model, x, y, epochs=1, lr=0.1, batch_size=8, optimizer="sgd", target_accuracy=2.0, progress=False,
                precision="mixed")
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = reference(x[torch.randperm(8, generator=torch.Generator().manual_seed(0))])
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(logits.float(), y[perm]).backward()
    opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_old_results_with_a_single_width_still_load_and_print(tmp_path):
    old = json.loads((Path(__file__).parents[2] / "docs/examples/study-output/results.json").read_text())
    old["config"].pop("widths", None)
    old["config"]["width"] = None
    for key in ("model", "device", "precision", "analysis_dtype"):
        old["config"].pop(key, None)
    for row in old["rows"]:
        row.pop("width", None)
    (tmp_path / "results.json").write_text(json.dumps(old))
    result = load_result(tmp_path / "results.json")
    table = format_table(result)
    assert "digits, mlp, torch" in table
    from normflat.study.run import correlations, psi_axes

    assert psi_axes(result.rows) == ["ratio"] and "width" in HYPERPARAMETERS
    again = correlations(result.rows, reparam=True)
    assert again["trained"]["normalized_sharpness"]["psi_per_axis"].keys() == {"ratio"}


def test_dataset_validation_in_python():
    arrays = features()
    with pytest.raises(StudyInputError, match="include -1"):
        from normflat.study.datasets import dataset_from_arrays

        dataset_from_arrays({**arrays, "y_train": arrays["y_train"] - 1}, name="n", source="s")
    with pytest.raises(StudyInputError, match="at least 2"):
        dataset_from_arrays({**arrays, "y_train": arrays["y_train"] * 0, "y_test": arrays["y_test"] * 0},
                            name="n", source="s")
    with pytest.raises(StudyInputError, match="whole numbers"):
        dataset_from_arrays({**arrays, "y_train": arrays["y_train"].astype(float)}, name="n", source="s")
    ids = dataset_from_arrays({**arrays, "x_train": np.arange(80).reshape(40, 2), "x_test": np.ones((30, 2), int)},
                              name="tokens", source="s")
    assert ids.x_train.dtype.kind == "i" and ids.input_shape == (2,)  # token ids stay integers
