"""CIFAR-10 from its standard python pickle batches, as a ``normflat study --dataset`` function.

``normflat study --dataset examples/study/cifar10.py:load`` calls :func:`load`
(with ``--data-dir DIR`` it calls ``load(DIR)``). Nothing is downloaded: point
``--data-dir`` or the environment variable ``CIFAR10_DIR`` at the unpacked
``cifar-10-python.tar.gz`` of https://www.cs.toronto.edu/~kriz/cifar.html, the
folder ``cifar-10-batches-py`` holding ``data_batch_1`` ... ``data_batch_5`` and
``test_batch`` (or the folder above it).

Each batch is a pickled dict with ``b"data"``, a ``(10000, 3072)`` uint8 array
whose rows hold the red, green and blue 32x32 planes of one image in row-major
order, and ``b"labels"``, a list of 10,000 class indices. The files are read with
an unpickler that accepts only numpy arrays and plain containers, so a tampered
file cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TRAIN_BATCHES", "TEST_BATCH", "find_batches", "read_batch", "load"]

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
_FILES = (*TRAIN_BATCHES, TEST_BATCH)
# What unpickling a CIFAR-10 batch needs (numpy arrays, across numpy 1 and 2; _codecs.encode is
# how Python 3 writes bytes into protocol-2 pickles), and nothing else.
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR-10 batch holds only arrays and lists")


def find_batches(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding the six batch files: ``data_dir``, else ``$CIFAR10_DIR``
    (either the folder itself or the one above ``cifar-10-batches-py``).

    Raises:
        FileNotFoundError: If no folder is given or a batch file is missing, with
            how to get them.
    """
    hint = ("Download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html once, unpack it, and "
            "pass --data-dir path/to/cifar-10-batches-py (or set CIFAR10_DIR). normflat never downloads data.")
    given = data_dir if data_dir is not None else os.environ.get("CIFAR10_DIR")
    if not given:
        raise FileNotFoundError(f"CIFAR-10: no folder given (neither --data-dir nor $CIFAR10_DIR). {hint}")
    root = Path(given)
    for folder in (root, root / "cifar-10-batches-py"):
        if all((folder / name).is_file() for name in _FILES):
            return folder
    missing = [name for name in _FILES if not (root / name).is_file()]
    raise FileNotFoundError(f"CIFAR-10 batches not found in {root}: missing {', '.join(missing)}. {hint}")


def read_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: images ``(n, 3, 32, 32)`` uint8 and labels ``(n,)`` int64.

    Raises:
        ValueError: If the file is not a CIFAR-10 python batch.
    """
    path = Path(path)
    try:
        batch = _ArraysOnly(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as err:
        raise ValueError(f"{path} is not a CIFAR-10 python batch ({type(err).__name__}: {err}); use the files of "
                         "cifar-10-python.tar.gz.") from err
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path} is not a CIFAR-10 python batch: expected a dict with b'data' and b'labels'.")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(f"{path}: b'data' has shape {data.shape} for {len(labels)} labels; expected (n, 3072), one "
                         "row of 3 x 32 x 32 values per label.")
    return data.reshape(-1, 3, 32, 32).astype(np.uint8), labels


def load(data_dir: str | os.PathLike | None = None, *, normalize: bool = True) -> dict[str, Any]:
    """CIFAR-10: 50,000 training and 10,000 test images, NCHW float32.

    Args:
        data_dir: The folder of the batch files (default ``$CIFAR10_DIR``).
        normalize: Standardize each colour channel with the training set's mean
            and standard deviation (the usual preprocessing of Wide ResNets);
            otherwise values in [0, 1].

    Returns:
        ``{"x_train", "y_train", "x_test", "y_test", "num_classes": 10}``: what
        ``normflat study --dataset`` takes from a dataset function.
    """
    folder = find_batches(data_dir)
    parts = [read_batch(folder / name) for name in TRAIN_BATCHES]
    x_train = np.concatenate([x for x, _ in parts]).astype(np.float32) / 255.0
    y_train = np.concatenate([y for _, y in parts])
    x_test, y_test = read_batch(folder / TEST_BATCH)
    x_test = x_test.astype(np.float32) / 255.0
    if normalize:
        mean = x_train.mean(axis=(0, 2, 3), keepdims=True, dtype=np.float64).astype(np.float32)
        std = x_train.std(axis=(0, 2, 3), keepdims=True, dtype=np.float64).astype(np.float32)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test, "num_classes": 10}
