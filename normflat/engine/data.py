"""The one data contract of every framework: what a batch, a pair and a label are.

A backend supplies a :class:`DataAdapter` (how to recognise and read its arrays
and datasets); everything else — which objects are accepted, how a single pair,
labels, one-hot rows, empty batches, ``max_batches`` and infinite datasets are
treated, and every error message — lives here, once:

* ``data`` is either one ``(x, y)`` pair of arrays, which is **one batch** (the
  backends chunk inside a batch to bound memory; results do not depend on the
  split), or an iterable of batches (DataLoader, ``tf.data.Dataset``, list,
  generator). A batch is an ``(x, y)`` pair (tuple or list), a mapping with
  keys ``"x"`` and ``"y"``, or a Hugging Face style mapping (a dict or
  ``BatchEncoding`` as data collators produce) whose ``"labels"`` (or
  ``"label"``) entry holds the labels and whose other entries (``input_ids``,
  ``attention_mask``, ``pixel_values``...) are the model's **keyword** inputs
  (:attr:`Batch.keywords`); ``x`` is an array or a tuple/list/dict of arrays
  (multi-input models), all with the same leading sample axis. A single such
  mapping is one batch, like a single pair.
* ``y`` holds integer class indices ``(n,)`` (also ``(n, 1)``, and floats with
  integral values), or one-hot rows ``(n, C)``, converted to indices. For
  token logits ``(n, T, C)`` it holds token labels ``(n, T)``, where
  ``ignore_index`` (default -100) marks tokens the loss does not count
  (method §6.3); with ``shift`` the label of position ``t`` is ``y[:, t + 1]``
  (causal language models fed ``labels = input_ids``). Soft
  (probability) labels are refused: the built-in losses are those of hard labels.
  With a custom loss callable, ``y`` is passed to it as given, and integer
  labels are still checked against the number of logits.
* Empty batches are skipped; data with no sample at all is an error.
* ``max_batches`` counts the batches of ``data`` (a single pair is one batch);
  a dataset that declares itself infinite (``tf.data`` ``.repeat()``) needs it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

import numpy as np

from normflat.engine.losses import quoted_error
from normflat.engine.options import AnalysisOptions, limited

__all__ = ["INFINITE", "DataAdapter", "Batch", "EmptyDataError", "batches", "labels_for", "input_leaves",
           "LABEL_KEYS", "non_finite_inputs", "PENDING_CHECKS", "describe_inputs", "model_fails_on_inputs",
           "first_forward", "model_failures", "raised_by_normflat"]

#: Keys of a Hugging Face style mapping batch that hold the labels (the rest are inputs).
LABEL_KEYS = ("labels", "label")


class _Infinite:
    def __repr__(self) -> str:
        return "INFINITE"


#: What :meth:`DataAdapter.cardinality` returns for a dataset that never ends.
INFINITE: Any = _Infinite()


class DataAdapter(Protocol):
    """What the engine needs to know about one framework's arrays and datasets."""

    framework: str

    def is_array(self, a: Any) -> bool:
        """Whether ``a`` is an array this backend takes (its own tensors, numpy arrays)."""

    def shape(self, a: Any) -> tuple[int, ...]:
        """The static shape of an array (python ints)."""

    def kind(self, a: Any) -> str:
        """``"f"`` floating, ``"i"`` integer (signed or unsigned), ``"b"`` bool, ``"c"`` complex, ``"?"``."""

    def to_numpy(self, a: Any) -> np.ndarray:
        """A host copy of a (small) array, for label checks."""

    def all_finite(self, a: Any) -> bool:
        """Whether a floating array has no NaN or infinity; ``True`` for an array on an
        accelerator whose check the session defers (:func:`non_finite_inputs`)."""

    def cardinality(self, data: Any) -> Any:
        """Number of batches of ``data``: an int, ``None`` if unknown, or :data:`INFINITE`."""

    def reject(self, data: Any) -> str | None:
        """A message if ``data`` is a framework object that is not a batch iterable (else None)."""

    def iterate(self, data: Any) -> Iterable[Any]:
        """Iterate the framework's dataset object (``tf.data`` yields tensors, not numpy)."""


class EmptyDataError(ValueError):
    """The data yielded no sample (in a distributed run: this rank's shard)."""


@dataclass
class Batch:
    """One non-empty batch, checked.

    Attributes:
        index: Position of the batch in the data (empty batches count).
        x: The inputs as given (array or tuple/list/dict of arrays).
        y: The labels as given.
        n: Number of samples.
        offset: Position of the batch's first sample among all samples seen so far
            (the stochastic estimators key their draws on it).
        keywords: ``x`` is a dict of keyword inputs (``model(**x)``), from a Hugging
            Face style mapping batch; otherwise ``x`` is passed positionally.
    """

    index: int
    x: Any
    y: Any
    n: int
    offset: int
    keywords: bool = False


def input_leaves(x: Any) -> list[Any]:
    """The arrays of an input structure (array, tuple/list/dict of arrays), in order."""
    if isinstance(x, Mapping):
        return [v for k in x for v in input_leaves(x[k])]
    if isinstance(x, (tuple, list)):
        return [v for item in x for v in input_leaves(item)]
    return [x]


def _readable(a: Any) -> bool:
    """An array of another framework that numpy can read: a torch tensor, a TensorFlow or JAX array
    (it has a shape, a dtype and ``__array__``)."""
    return (hasattr(a, "__array__") and hasattr(a, "shape") and hasattr(a, "dtype")
            and not isinstance(a, (str, bytes, type, np.ndarray)))


def _is_array(a: Any, adapter: DataAdapter) -> bool:
    """An array the batch may hold: the backend's, numpy, or one numpy reads (:func:`_readable`)."""
    return adapter.is_array(a) or _readable(a)


def _to_host(a: Any) -> np.ndarray:
    """Another framework's array as a writable numpy array: a torch tensor detached and copied from
    its device first, a dtype numpy lacks (bfloat16) widened. A read-only view (TensorFlow's) is
    copied: PyTorch warns about wrapping one."""
    if hasattr(a, "detach"):
        a = a.detach().cpu()
    try:
        out = np.asarray(a)
    except TypeError:  # bfloat16, which numpy has no dtype for
        out = np.asarray(a.float() if hasattr(a, "float") else a.astype("float32"))
    return out if out.flags.writeable else out.copy()


def _read_foreign(value: Any, adapter: DataAdapter) -> Any:
    """``value`` (inputs or labels) with the arrays of other frameworks read into numpy, which every
    backend takes (a torch ``DataLoader`` feeding a Keras model, as Keras' own ``fit`` accepts; a
    ``tf.data`` pipeline feeding a PyTorch model); the structure and the backend's own arrays are kept,
    and ``value`` itself is returned where nothing needed reading."""
    if isinstance(value, Mapping):
        items = {k: _read_foreign(v, adapter) for k, v in value.items()}
        return value if all(items[k] is value[k] for k in items) else items
    if isinstance(value, (tuple, list)):
        parts = [_read_foreign(v, adapter) for v in value]
        if all(p is v for p, v in zip(parts, value)):
            return value
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    if adapter.is_array(value) or not _readable(value):
        return value
    return _to_host(value)


def _is_inputs(x: Any, adapter: DataAdapter) -> bool:
    if isinstance(x, (Mapping, tuple, list)):
        leaves = input_leaves(x)
        return bool(leaves) and all(_is_array(v, adapter) for v in leaves)
    return _is_array(x, adapter)


def _is_single_pair(data: Any, adapter: DataAdapter) -> bool:
    if isinstance(data, Mapping):  # one Hugging Face style batch ({"input_ids": ..., "labels": ...})
        key = _label_key(data)
        return key is not None and _is_array(data[key], adapter) and all(
            _is_inputs(v, adapter) for k, v in data.items() if k != key)
    return (isinstance(data, (tuple, list)) and len(data) == 2 and _is_array(data[1], adapter)
            and _is_inputs(data[0], adapter))


def _label_key(batch: Mapping) -> str | None:
    if "x" in batch and "y" in batch:
        return None
    return next((k for k in LABEL_KEYS if k in batch), None)


def _split(batch: Any, index: int) -> tuple[Any, Any, bool]:
    if isinstance(batch, Mapping):
        if "x" in batch and "y" in batch:
            return batch["x"], batch["y"], False
        key = _label_key(batch)
        if key is not None:
            inputs = {k: v for k, v in batch.items() if k != key}
            if not inputs:
                raise TypeError(f"Batch {index} is a mapping with only {key!r}; it needs the model's inputs too.")
            return inputs, batch[key], True
        raise TypeError(
            f"Batch {index} is a mapping with keys {sorted(map(str, batch))} but no labels; a mapping "
            "batch needs the keys 'x' (inputs) and 'y' (labels), or Hugging Face style keyword inputs "
            "with a 'labels' entry (as a data collator produces). Otherwise yield (x, y) pairs."
        )
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1], False
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        raise TypeError(
            f"Batch {index} has 3 entries (x, y, sample weights?); normflat analyzes the plain mean "
            "loss, so batches must be (x, y) pairs. Drop the sample weights."
        )
    what = type(batch).__name__ + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    raise TypeError(
        f"Batch {index} is a {what}; every batch must be an (x, y) pair of inputs and class labels "
        "(a dataset of single samples must be batched first, e.g. with a DataLoader)."
    )


def _check_batch(x: Any, y: Any, index: int, adapter: DataAdapter) -> int:
    leaves = input_leaves(x)
    if not leaves or not all(adapter.is_array(v) for v in leaves):
        bad = next((type(v).__name__ for v in leaves if not adapter.is_array(v)), "nothing")
        hint = ""
        if isinstance(x, (tuple, list)) and leaves and not any(adapter.is_array(v) for v in leaves):
            # Nested Python lists of numbers (an array's .tolist()) read as one input per entry.
            bad = f"a {type(x).__name__} of {len(x)} entries holding {bad} values"
            hint = " Convert nested Python lists of numbers to an array (np.asarray(x)) first."
        raise TypeError(
            f"Batch {index}: the inputs x must be an array (or a tuple/list/dict of arrays): the "
            f"{adapter.framework} backend's, numpy's or another framework's that numpy reads, got {bad}.{hint}"
        )
    shapes = [adapter.shape(v) for v in leaves]
    if any(len(s) == 0 for s in shapes):
        raise ValueError(f"Batch {index}: every input array needs a leading batch axis; got a scalar.")
    n = int(shapes[0][0])
    if any(int(s[0]) != n for s in shapes):
        raise ValueError(
            f"Batch {index}: the input arrays have different numbers of samples "
            f"{[int(s[0]) for s in shapes]}; every input of a batch needs the same leading size."
        )
    if not adapter.is_array(y):
        raise TypeError(
            f"Batch {index}: the labels y must be an array (the {adapter.framework} backend's, numpy's or "
            f"another framework's that numpy reads), got {type(y).__name__}."
        )
    y_shape = adapter.shape(y)
    if len(y_shape) == 0:
        raise ValueError(f"Batch {index}: the labels are a scalar; expected one label per sample, shape ({n},).")
    if int(y_shape[0]) != n:
        raise ValueError(
            f"Batch {index}: {n} inputs but {int(y_shape[0])} labels; x and y of a batch must have the "
            "same number of samples."
        )
    if n:
        for v in leaves:
            if adapter.kind(v) == "f" and not adapter.all_finite(v):
                raise non_finite_inputs(index)
    return n


#: The deferred value checks a session holds at most (each a few numbers on the device) before it
#: reads them: a pass over a large dataset does not accumulate them, at one wait for the device per
#: hundreds of batches.
PENDING_CHECKS = 1024


def non_finite_inputs(index: int) -> ValueError:
    """The one error for NaN or infinite inputs in batch ``index``: raised here for host arrays,
    and by a session for device arrays, whose check it defers (an adapter's ``all_finite`` answers
    ``True`` for them) to one device synchronisation after the loop."""
    return ValueError(
        f"Batch {index}: the inputs contain NaN or infinite values; clean or impute the data before analyzing."
    )


#: Input arrays named in :func:`describe_inputs` (then a count).
_DESCRIBED_INPUTS = 4


def _describe_array(a: Any) -> str:
    shape = tuple(None if d is None else int(d) for d in getattr(a, "shape", ()))
    dtype = getattr(a, "dtype", None)
    name = getattr(dtype, "name", None)  # numpy, TensorFlow; torch's dtypes print as "torch.float64"
    return f"{name if isinstance(name, str) else str(dtype).rsplit('.', 1)[-1]} {shape}"


def describe_inputs(x: Any) -> str:
    """A batch's inputs for a message: each array's dtype and shape, by name in a mapping and by
    position in a tuple or list, the first few (then a count)."""
    if isinstance(x, Mapping):
        items = [(f"{k} ", v) for k, v in x.items()]
    elif isinstance(x, (tuple, list)):
        items = [(f"[{i}] ", v) for i, v in enumerate(x)]
    else:
        return _describe_array(x)
    parts = [name + (_describe_array(v) if not isinstance(v, (Mapping, tuple, list)) else type(v).__name__)
             for name, v in items[:_DESCRIBED_INPUTS]]
    more = len(items) - _DESCRIBED_INPUTS
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def model_fails_on_inputs(framework: str, error: BaseException, batch: Batch) -> ValueError:
    """The one error every framework gives when the model's first forward fails on a batch's inputs
    (inputs that do not fit the model: another number of features, another dtype, the axes in
    another order), in place of an error from deep inside the framework; the model's own error is
    quoted and chained (``raise model_fails_on_inputs(...) from error``).

    Each backend calls it where it first runs the model on the data, without normflat's recording
    (PyTorch and Keras: the first rows of the first batch; JAX: the first rows, after its per-example
    trace failed). Errors that normflat raises itself (:func:`raised_by_normflat`) pass unchanged.

    Args:
        framework: ``"torch"``, ``"keras"`` or ``"jax"``, for the message.
        error: The model's error.
        batch: The batch whose inputs it failed on.
    """
    return ValueError(
        f"The {framework} model fails on the inputs of batch {batch.index} ({describe_inputs(batch.x)}"
        f"{', as keyword arguments' if batch.keywords else ''}): {quoted_error(error)}. normflat calls the "
        "model on each batch's inputs as the data gives them, so they must be what the model takes: "
        "their shape, with the samples along the first axis (any number of them: normflat also runs the "
        "model on a few rows and on one sample), their dtype and their order. Check that "
        "the model runs on one batch of the data outside normflat."
    )


@contextlib.contextmanager
def first_forward(framework: str, batch: Batch) -> Iterator[None]:
    """Around a backend's first forward of the model on ``batch``: an error the model raises becomes
    :func:`model_fails_on_inputs` (the model's error chained); normflat's own
    (:func:`raised_by_normflat`) passes unchanged."""
    try:
        yield
    except Exception as err:
        if raised_by_normflat(err):
            raise
        raise model_fails_on_inputs(framework, err, batch) from err


@contextlib.contextmanager
def model_failures(framework: str, batch: Batch,
                   forward_error: Callable[[Batch], BaseException | None]) -> Iterator[None]:
    """Around a backend's work on ``batch``: an error that normflat did not raise itself
    (:func:`raised_by_normflat`), where the model's own forward fails on the batch's inputs too,
    becomes :func:`model_fails_on_inputs` (the forward's error chained); any other error stands.

    :func:`first_forward` sees the first batch's inputs only; this covers a later batch of another
    shape or dtype, wherever its work fails (a compiled step, a per-sample transform). The forward
    runs only after a failure, so a batch that works costs nothing.

    Args:
        framework: ``"torch"``, ``"keras"`` or ``"jax"``, for the message.
        batch: The batch being worked on.
        forward_error: The model's error on the first rows of a batch's inputs, from its plain
            forward (no recording, no gradients), or ``None`` where it runs.
    """
    try:
        yield
    except Exception as err:
        cause = None if raised_by_normflat(err) else forward_error(batch)
        if cause is None:
            raise
        raise model_fails_on_inputs(framework, cause, batch) from cause


#: normflat's own directory: an error raised in its code is its own (:func:`raised_by_normflat`).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def raised_by_normflat(error: BaseException) -> bool:
    """Whether normflat raised ``error`` itself, rather than the model or its framework: the
    innermost Python frame of its traceback is a ``raise`` statement in normflat's code. A check's
    own error keeps its message instead of :func:`model_fails_on_inputs`; a framework's error that
    only passes through normflat's code (PyTorch's ``__torch_function__`` shims, the call of a JAX
    model whose internal frames JAX filters out) ends at a call, not at a ``raise``."""
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    filename = last.tb_frame.f_code.co_filename
    return (filename.startswith(_PACKAGE_DIR)
            and linecache.getline(filename, last.tb_lineno).lstrip().startswith("raise"))


def batches(data: Any, adapter: DataAdapter, options: AnalysisOptions) -> tuple[Iterator[Batch], int | None]:
    """The checked, non-empty batches of ``data`` and their number when known.

    Raises:
        TypeError: If ``data`` or a batch has the wrong structure or types.
        ValueError: For infinite data without ``max_batches``, mismatched sizes,
            NaN/inf inputs, or data without any sample (raised when exhausted).
    """
    if data is None:
        raise ValueError(
            "analyze(model, data) needs training data: the Hessian diagonal is that of the mean "
            "training loss over the data you pass."
        )
    if _is_single_pair(data, adapter):
        source: Iterable[Any] = [data if isinstance(data, Mapping) else tuple(data)]
        total: int | None = 1
    else:
        message = adapter.reject(data)
        if message:
            raise TypeError(message)
        if isinstance(data, (str, bytes, Mapping)) or _is_array(data, adapter) or not hasattr(data, "__iter__"):
            raise TypeError(
                f"data must be one (x, y) pair of arrays or an iterable of (x, y) batches (a DataLoader, "
                f"a tf.data.Dataset, a list, a generator), got {type(data).__name__}."
            )
        total = adapter.cardinality(data)
        if total is INFINITE:
            if options.max_batches is None:
                raise ValueError(
                    "The data is infinite (its cardinality says so, e.g. a tf.data dataset with "
                    ".repeat()), so the analysis would never end. Remove .repeat() or pass "
                    "max_batches=N to analyze the first N batches."
                )
            total = options.max_batches
        source = adapter.iterate(data)
    if total is not None and options.max_batches is not None:
        total = min(total, options.max_batches)
    return _generate(source, adapter, options), total


def _generate(source: Iterable[Any], adapter: DataAdapter, options: AnalysisOptions) -> Iterator[Batch]:
    offset = 0
    for index, raw in enumerate(limited(source, options.max_batches)):
        x, y, keywords = _split(raw, index)
        x, y = _read_foreign(x, adapter), _read_foreign(y, adapter)
        n = _check_batch(x, y, index, adapter)
        if n == 0:
            continue  # an empty batch adds nothing (the same in every framework)
        yield Batch(index, x, y, n, offset, keywords)
        offset += n
    if offset == 0:
        raise EmptyDataError(
            "The data is empty: it yielded no sample. Pass at least one (x, y) batch with samples."
        )


def labels_for(batch: Batch, num_classes: int, adapter: DataAdapter, options: AnalysisOptions,
               tokens: int | None = None, shift: bool = False) -> np.ndarray | None:
    """Class indices of a batch as an ``int64`` host array, checked against ``num_classes``.

    Args:
        batch: The batch.
        num_classes: ``C``, the last axis of the logits.
        adapter: The backend's data adapter.
        options: The analysis options (``loss``, ``ignore_index``).
        tokens: ``T`` when the logits are token logits ``(n, T, C)``; the labels must
            then be ``(n, T)`` token labels, and the result is ``(n, T)`` with
            ``options.ignore_index`` at the tokens not counted.
        shift: Token logits at ``t`` predict the label at ``t + 1`` (causal language
            models): the result at ``t`` is ``y[:, t + 1]``, the last position ignored.

    Returns ``None`` for a custom loss whose labels are not integer class indices
    (they are passed to the loss as given).

    Raises:
        TypeError: For labels that are not class indices or one-hot rows.
        ValueError: For labels out of range, soft labels, or shapes that do not fit.
    """
    if tokens is not None:
        return _token_labels(batch, num_classes, int(tokens), adapter, options, shift)
    index, y = batch.index, batch.y
    kind = adapter.kind(y)
    shape = adapter.shape(y)
    custom = callable(options.loss)
    if custom and not (kind == "i" and len(shape) == 1):
        return None  # the custom loss receives y as given
    arr = np.asarray(adapter.to_numpy(y))
    if kind == "b" or kind == "c" or kind == "?":
        raise TypeError(
            f"Batch {index}: labels have dtype {arr.dtype}; normflat needs integer class indices "
            "(or one-hot rows)."
        )
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim == 2:
        if arr.shape[1] != num_classes:
            raise ValueError(
                f"Batch {index}: labels have shape {arr.shape}, but the model has {num_classes} outputs; "
                "pass class indices of shape (n,) or one-hot rows of shape (n, classes)."
            )
        if not np.all(np.isfinite(arr)) or not np.all((arr == 0) | (arr == 1)) or not np.all(arr.sum(1) == 1):
            raise ValueError(
                f"Batch {index}: 2-D labels must be one-hot rows (one 1 per row, zeros elsewhere); soft or "
                "smoothed labels are not supported, because normflat's losses are those of hard labels. "
                "Pass the class indices (y.argmax(-1))."
            )
        return arr.argmax(1).astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(
            f"Batch {index}: labels have shape {arr.shape}; expected class indices of shape (n,) or "
            "one-hot rows (n, classes)."
        )
    if kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(
                f"Batch {index}: floating-point labels must hold integer class indices; got non-integer "
                "or non-finite values. Pass integer class indices."
            )
    ids = arr.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError(
            f"Batch {index}: labels must be class indices in [0, {num_classes - 1}] for a model with "
            f"{num_classes} outputs, got values in [{int(ids.min())}, {int(ids.max())}]."
        )
    return ids


def _token_labels(batch: Batch, num_classes: int, tokens: int, adapter: DataAdapter, options: AnalysisOptions,
                  shift: bool) -> np.ndarray | None:
    index, y = batch.index, batch.y
    kind = adapter.kind(y)
    shape = tuple(int(d) for d in adapter.shape(y))
    if callable(options.loss) and not (kind == "i" and len(shape) == 2):
        return None  # the custom loss receives y as given
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1 and tokens != 1):
        raise ValueError(
            f"Batch {index}: the model returns token logits of shape ({batch.n}, {tokens}, {num_classes}) but "
            f"the labels {shape} hold one class per sample. For a classifier, reduce the sequence in the "
            "model (pool, or take the first token) so that it returns (batch, classes) logits; for a "
            "sequence model pass token labels of shape (batch, tokens)."
        )
    if len(shape) != 2:
        raise ValueError(
            f"Batch {index}: token labels have shape {shape}; for token logits ({batch.n}, {tokens}, "
            f"{num_classes}) normflat needs integer token labels of shape ({batch.n}, {tokens}) (soft or one-hot "
            "token labels are not supported), with ignore_index marking tokens not counted."
        )
    if shape[1] != tokens:
        raise ValueError(
            f"Batch {index}: {shape[1]} token labels per sample but the model returns logits for {tokens} "
            "tokens; pass labels of the same length as the model's output sequence."
        )
    arr = np.asarray(adapter.to_numpy(y))
    if kind not in ("i", "f"):
        raise TypeError(f"Batch {index}: token labels have dtype {arr.dtype}; normflat needs integer token ids.")
    if kind == "f" and (not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr))):
        raise ValueError(
            f"Batch {index}: floating-point token labels must hold integer class indices; pass integer labels."
        )
    ids = arr.astype(np.int64)
    ignored = ids == options.ignore_index
    bad = ~ignored & ((ids < 0) | (ids >= num_classes))
    if bad.any():
        v = ids[bad]
        raise ValueError(
            f"Batch {index}: token labels must be class indices in [0, {num_classes - 1}] or "
            f"ignore_index={options.ignore_index} (tokens not counted), got values in "
            f"[{int(v.min())}, {int(v.max())}]. Pass ignore_index= if your data marks padding differently."
        )
    ids = np.where(ignored, options.ignore_index, ids)
    if shift:
        ids = np.concatenate([ids[:, 1:], np.full((ids.shape[0], 1), options.ignore_index, np.int64)], axis=1)
    return ids
