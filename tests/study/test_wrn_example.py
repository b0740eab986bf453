"""The paper's WRN-on-CIFAR-10 protocol: examples/study/wrn.py and examples/study/cifar10.py."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch", "normflat.backends.torch")

import torch  # noqa: E402

import normflat  # noqa: E402
from normflat.cli import main  # noqa: E402
from normflat.study.reparametrize import apply_rescaling, check_same_function, random_rescaling  # noqa: E402
from normflat.study.run import load_result  # noqa: E402

EXAMPLES = Path(__file__).parents[2] / "examples" / "study"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wrn = load_example("wrn")
cifar10 = load_example("cifar10")


def with_statistics(model, seed=0):
    """A float64 eval-mode copy whose BatchNorm layers have non-trivial statistics and weights."""
    model = model.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen, dtype=torch.float64) + 0.1)
                m.weight.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
                m.bias.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
    return model.eval()


def test_wide_resnet_structure_seed_and_random_state():
    state = torch.random.get_rng_state()
    a = wrn.wide_resnet((3, 8, 8), 10, width=2, seed=1, depth=10, widen=2)
    b = wrn.wide_resnet((3, 8, 8), 10, width=2, seed=1, depth=10, widen=2)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's generator did not move
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # depth 10: one pre-activation block per group; channels 2 -> 4, 8, 16 (widen 2)
    convs = [m for m in a.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [tuple(c.weight.shape[:2]) for c in convs] == [(2, 3), (4, 2), (4, 4), (4, 2), (8, 4), (8, 8), (8, 4),
                                                           (16, 8), (16, 16), (16, 8)]
    assert a(torch.randn(5, 3, 8, 8)).shape == (5, 10)
    # WRN-16-4 as in the paper: 2.75 M parameters
    full = wrn.wide_resnet((3, 32, 32), 10)
    assert sum(p.numel() for p in full.parameters()) == 2_748_890
    with pytest.raises(ValueError, match="6n \\+ 4"):
        wrn.wide_resnet((3, 8, 8), 10, depth=12)
    with pytest.raises(ValueError, match="channels, height, width"):
        wrn.wide_resnet((3, 8), 10)


def test_the_rescaler_preserves_the_wide_resnet_function():
    model = with_statistics(wrn.wide_resnet((3, 8, 8), 10, width=2, seed=0, depth=16, widen=1))
    rescaling = random_rescaling(model, orders=3.0, seed=2)
    # Every block's first convolution feeds only a BatchNorm; the second convolutions and
    # shortcuts feed the residual sums and are left alone, and so is the stem here: with
    # widen 1 the first block has an identity shortcut, so the stem feeds a sum too.
    assert rescaling.kinds == {f"blocks.{i}.conv1": "before-batchnorm" for i in range(6)}
    widened = random_rescaling(with_statistics(wrn.wide_resnet((3, 8, 8), 10, width=2, depth=10, widen=2)))
    assert widened.kinds == {"conv": "before-batchnorm", **{f"blocks.{i}.conv1": "before-batchnorm" for i in range(3)}}
    assert rescaling.spread > 4.0
    rescaled = apply_rescaling(model, rescaling)
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    assert check_same_function(model, rescaled, x, rtol=1e-12) <= 1e-12
    # Brute force: the rescaled conv weights really are the original times the factors.
    c = torch.as_tensor(rescaling.factors["blocks.2.conv1"])
    torch.testing.assert_close(rescaled.blocks[2].conv1.weight, model.blocks[2].conv1.weight * c.view(-1, 1, 1, 1),
                               rtol=1e-15, atol=0)
    y = torch.arange(6) % 10
    base = normflat.analyze(model, [(x, y)], progress=False)
    after = normflat.analyze(rescaled, [(x, y)], progress=False)
    assert after.normalized_sharpness == pytest.approx(base.normalized_sharpness, rel=1e-10)
    assert abs(np.log10(after.hessian_trace / base.hessian_trace)) > 0.3


def write_cifar(folder, n_per_batch=4, seed=0):
    """Six batch files in the CIFAR-10 python format (protocol-2 pickles of byte-keyed dicts)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = {}, {}
    for name in (*cifar10.TRAIN_BATCHES, cifar10.TEST_BATCH):
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, n_per_batch)]
        batch = {b"batch_label": name.encode(), b"labels": y, b"data": data,
                 b"filenames": [f"img{i}.png".encode() for i in range(n_per_batch)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        images[name], labels[name] = data, y
    return images, labels


def test_cifar10_loader_reads_the_real_format(tmp_path, monkeypatch):
    images, labels = write_cifar(tmp_path / "cifar-10-batches-py")
    raw = cifar10.load(tmp_path, normalize=False)  # the folder above cifar-10-batches-py works too
    assert raw["x_train"].shape == (20, 3, 32, 32) and raw["x_test"].shape == (4, 3, 32, 32)
    assert raw["x_train"].dtype == np.float32 and raw["num_classes"] == 10
    first = images["data_batch_1"][1]
    # Row layout: 1024 red values, then green, then blue, each 32x32 row-major.
    assert raw["x_train"][1, 0, 0, 5] == pytest.approx(first[5] / 255.0)
    assert raw["x_train"][1, 1, 2, 3] == pytest.approx(first[1024 + 2 * 32 + 3] / 255.0)
    assert raw["x_train"][1, 2, 31, 31] == pytest.approx(first[3071] / 255.0)
    np.testing.assert_array_equal(raw["y_train"], sum((labels[n] for n in cifar10.TRAIN_BATCHES), []))
    np.testing.assert_array_equal(raw["y_test"], labels["test_batch"])
    monkeypatch.setenv("CIFAR10_DIR", str(tmp_path / "cifar-10-batches-py"))
    norm = cifar10.load()
    mean = raw["x_train"].astype(np.float64).mean(axis=(0, 2, 3))
    std = raw["x_train"].astype(np.float64).std(axis=(0, 2, 3))
    np.testing.assert_allclose(norm["x_train"].astype(np.float64).mean(axis=(0, 2, 3)), 0.0, atol=1e-5)
    np.testing.assert_allclose(norm["x_test"][0, :, 0, 0], (raw["x_test"][0, :, 0, 0] - mean) / std, rtol=1e-5)


def test_cifar10_loader_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("CIFAR10_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="neither --data-dir nor \\$CIFAR10_DIR.*never downloads"):
        cifar10.load()
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="missing data_batch_3"):
        cifar10.load(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(ValueError, match="refusing to load"):
        cifar10.load(tmp_path)


def test_the_wrn_protocol_end_to_end_on_a_tiny_cifar(tmp_path, monkeypatch, capsys):
    write_cifar(tmp_path / "cifar", n_per_batch=6)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tinywrn.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('wrn_example', {str(EXAMPLES / 'wrn.py')!r})\n"
        "wrn = importlib.util.module_from_spec(spec); spec.loader.exec_module(wrn)\n"
        "def tiny(input_shape, num_classes, width=None, seed=0):\n"
        "    return wrn.wide_resnet(input_shape, num_classes, width=width or 2, seed=seed, depth=10, widen=1)\n")
    code = main(["study", "--model", "tinywrn.py:tiny", "--dataset", f"{EXAMPLES / 'cifar10.py'}:load",
                 "--data-dir", "cifar", "--device", "cpu", "--precision", "mixed", "--optimizer", "sgd", "--lr", "0.05",
                 "--batch-size", "16", "--ratios", "0,1", "--seeds", "1", "--epochs", "1", "--train-size", "24",
                 "--test-size", "6", "--no-progress", "--out", "wrn-out"])
    assert code == 0
    result = load_result(tmp_path / "wrn-out" / "results.json")
    assert result.config["optimizer"] == "sgd" and result.config["precision"] == "mixed"
    assert len(result.rows) == 2
    for r in result.rows:
        assert r["rescale_function_error"] < 1e-9
        assert r["rescaled_normalized_sharpness"] == pytest.approx(r["normalized_sharpness"], rel=1e-8)
    report = json.loads((tmp_path / "wrn-out" / "reports" / "run000.json").read_text())
    # 9 convolutions (the first block, 2 -> 2 channels, has an identity shortcut) and the classifier
    assert len(report["layers"]) == 10
