"""normflat.compare: a folder of checkpoints, their gaps, Kendall's tau, outputs and the CLI."""

from __future__ import annotations

import csv
import json
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402

import normflat  # noqa: E402
from normflat.checkpoints import CheckpointError  # noqa: E402
from normflat.cli import main  # noqa: E402
from normflat.compare import CompareResult, compare_checkpoints, expand_checkpoints  # noqa: E402
from normflat.study.outputs import MANIFEST  # noqa: E402
from normflat.study.stats import kendall_tau  # noqa: E402

FACTORY = """
    from torch import nn

    def make_net():
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
"""


@pytest.fixture
def family(tmp_path, monkeypatch):
    """Four checkpoints trained on 0, 30, 60, 100 % random labels, and train/test .npz files."""
    name = f"cmpfac_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    from normflat.checkpoints import resolve_factory

    make = resolve_factory(f"{name}:make_net")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)).astype("float32")
    y = ((x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.3)).astype("int64")
    xt = rng.normal(size=(80, 4)).astype("float32")
    yt = ((xt[:, 0] > 0).astype("int64") + (xt[:, 1] > 0.3)).astype("int64")
    np.savez(tmp_path / "test.npz", x=xt, y=yt)
    (tmp_path / "ckpts").mkdir()
    train_sets = {}
    for k, ratio in enumerate((0.0, 0.3, 0.6, 1.0)):
        labels = y.copy()
        flip = rng.random(len(y)) < ratio
        labels[flip] = rng.integers(0, 3, flip.sum())
        train_sets[k] = labels
        torch.manual_seed(k)
        net = make()
        opt = torch.optim.Adam(net.parameters(), lr=2e-2)
        xs, ys = torch.as_tensor(x), torch.as_tensor(labels)
        for _ in range(80):
            loss = torch.nn.functional.cross_entropy(net(xs), ys)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.save(net.state_dict(), tmp_path / "ckpts" / f"r{k}.pt")
    # The measures are computed on the training data: here the clean labels for every model
    # (one --train file), which is what a user comparing checkpoints of one run passes.
    np.savez(tmp_path / "train.npz", x=x, y=y)
    return name, tmp_path


def test_compare_checkpoints_api(family):
    name, tmp = family
    result = compare_checkpoints(tmp / "ckpts", factory=f"{name}:make_net", train=tmp / "train.npz",
                                 test=str(tmp / "test.npz"), batch_size=50)
    assert isinstance(result, CompareResult)
    assert [r["checkpoint"] for r in result.rows] == ["r0.pt", "r1.pt", "r2.pt", "r3.pt"]
    for r in result.rows:
        assert r["gap"] == pytest.approx(r["train_accuracy"] - r["test_accuracy"])
        assert r["examples"] == 120 and r["normalized_sharpness"] > 0
    for m in normflat.MEASURES:
        expected = kendall_tau([r[m] for r in result.rows], [r["gap"] for r in result.rows])
        assert result.correlations[m]["tau"] == pytest.approx(expected)
    # The row's measures are those of a direct analysis of the checkpoint.
    from normflat.checkpoints import load_data, load_model

    model = load_model(tmp / "ckpts" / "r2.pt", factory=f"{name}:make_net")
    x, y = load_data(tmp / "train.npz")
    direct = normflat.analyze(model, (torch.as_tensor(x), torch.as_tensor(y)), progress=False)
    assert result.rows[2]["normalized_sharpness"] == pytest.approx(direct.normalized_sharpness, rel=1e-5)
    table = result.table()
    assert "r3.pt" in table and "Kendall's tau" in table
    result.to_csv(tmp / "c.csv")
    rows = list(csv.DictReader(Path(tmp / "c.csv").read_text().splitlines()))
    assert len(rows) == 4 and float(rows[0]["gap"]) == pytest.approx(result.rows[0]["gap"])
    data = json.loads(Path(result.to_json(tmp / "c.json", reports_dir=tmp / "reps")).read_text())
    assert data["schema"] == "normflat.compare/1" and len(data["rows"]) == 4
    assert sorted(p.name for p in (tmp / "reps").iterdir()) == ["r0.pt.json", "r1.pt.json", "r2.pt.json",
                                                                "r3.pt.json"]
    fig = result.plot()
    assert len(fig.axes) == 4 and "Kendall" in fig.axes[0].get_title()
    assert (tmp / "c.png").exists() is False and result.figure(tmp / "c.png") and (tmp / "c.png").stat().st_size > 1000


def test_two_checkpoints_have_no_tau_and_errors(family):
    name, tmp = family
    files = expand_checkpoints(str(tmp / "ckpts" / "r[01].pt"))
    assert [f.rsplit("/", 1)[-1] for f in files] == ["r0.pt", "r1.pt"]
    x, y = np.load(tmp / "test.npz")["x"], np.load(tmp / "test.npz")["y"]
    result = compare_checkpoints(files, factory=f"{name}:make_net", train=(x, y), test=(x, y))
    assert all(c["tau"] is None for c in result.correlations.values())
    assert all(r["gap"] == 0 for r in result.rows)
    assert "at least 3 checkpoints" in result.table()
    with pytest.raises(CheckpointError, match="No checkpoint matches"):
        expand_checkpoints(str(tmp / "none" / "*.pt"))
    (tmp / "emptydir").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        expand_checkpoints(tmp / "emptydir")
    with pytest.raises(CheckpointError, match="needs test data"):
        compare_checkpoints(files, factory=f"{name}:make_net", train=(x, y))
    with pytest.raises(CheckpointError, match="holds a state_dict"):
        compare_checkpoints(files, train=(x, y), test=(x, y))


def test_compare_cli(family, capsys):
    name, tmp = family
    out = tmp / "out"
    assert main(["compare", str(tmp / "ckpts" / "r*.pt"), "--model", f"{name}:make_net",
                 "--train", str(tmp / "train.npz"), "--test", str(tmp / "test.npz"), "--out", str(out),
                 "--estimator", "ggn", "--loss", "ce"]) == 0
    text = capsys.readouterr().out
    assert "r0.pt: train acc" in text and "Kendall's tau" in text
    assert {p.name for p in out.iterdir()} == {"compare.csv", "compare.json", "compare.png", "reports", MANIFEST}
    data = json.loads((out / "compare.json").read_text())
    assert data["settings"]["loss"] == "ce" and len(data["rows"]) == 4
    # A second, smaller run into the same folder leaves no file of the first, and none of the user's goes.
    (out / "reports" / "notes.txt").write_text("mine")
    assert main(["compare", str(tmp / "ckpts" / "r0.pt"), str(tmp / "ckpts" / "r1.pt"), "--model",
                 f"{name}:make_net", "--train", str(tmp / "train.npz"), "--test", str(tmp / "test.npz"),
                 "--out", str(out), "--no-progress", "--no-figure"]) == 0
    assert sorted(p.name for p in (out / "reports").iterdir()) == ["notes.txt", "r0.pt.json", "r1.pt.json"]
    assert not (out / "compare.png").exists()
    assert len(json.loads((out / "compare.json").read_text())["rows"]) == 2
    (tmp / "afile").write_text("x")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp / "ckpts"), "--model", f"{name}:make_net", "--train",
              str(tmp / "train.npz"), "--test", str(tmp / "test.npz"), "--out", str(tmp / "afile")])
    assert info.value.code == 2 and "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp / "ckpts"), "--train", "t.npz"])  # --test is required
    assert info.value.code == 2 and "--test" in capsys.readouterr().err
    # A state_dict without --model: one line naming the fix.
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp / "ckpts"), "--train", str(tmp / "train.npz"), "--test", str(tmp / "test.npz"),
              "--out", str(tmp / "o2")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "holds a state_dict" in err and "--model" in err and not (tmp / "o2").exists()
