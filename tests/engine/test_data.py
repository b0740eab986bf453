"""The data contract of :mod:`normflat.engine.data`, with a numpy adapter (no framework)."""

from __future__ import annotations

import numpy as np
import pytest

from normflat.engine import EmptyDataError, validate_options
from normflat.engine.data import (Batch, batches, describe_inputs, input_leaves, labels_for, model_fails_on_inputs,
                                  raised_by_normflat)
from tests.engine._fakes import Infinite, NumpyAdapter

ADAPTER = NumpyAdapter()
RNG = np.random.default_rng(0)


def _xy(n, d=3, classes=4):
    return RNG.normal(size=(n, d)), RNG.integers(0, classes, size=n)


def _all(data, **options):
    it, total = batches(data, ADAPTER, validate_options(**options))
    return list(it), total


# ----------------------------------------------------------------------------- structure


def test_single_pair_is_one_batch():
    x, y = _xy(10)
    for data in ((x, y), [x, y]):
        got, total = _all(data)
        assert total == 1 and len(got) == 1
        b = got[0]
        assert (b.index, b.n, b.offset) == (0, 10, 0)
        assert b.x is x and b.y is y


def test_list_and_generator_of_batches():
    pairs = [_xy(4), _xy(4), _xy(2)]
    got, total = _all(pairs)
    assert total == 3
    assert [(b.index, b.n, b.offset) for b in got] == [(0, 4, 0), (1, 4, 4), (2, 2, 8)]
    got, total = _all(p for p in pairs)
    assert total is None  # a generator has no length
    assert [b.offset for b in got] == [0, 4, 8]


def test_mapping_batches():
    x, y = _xy(5)
    got, _ = _all([{"x": x, "y": y, "extra": 1}])
    assert got[0].x is x and got[0].y is y
    with pytest.raises(TypeError, match="keys 'x'"):
        _all([{"inputs": x, "targets": y}])
    # Hugging Face style: the labels entry is y, the rest are keyword inputs.
    got, _ = _all([{"input_ids": x, "attention_mask": x, "labels": y}])
    assert got[0].keywords and set(got[0].x) == {"input_ids", "attention_mask"} and got[0].y is y
    got, _ = _all({"pixel_values": x, "label": y})  # a single mapping is one batch
    assert len(got) == 1 and got[0].keywords and list(got[0].x) == ["pixel_values"]
    with pytest.raises(TypeError, match="only 'labels'"):
        _all([{"labels": y}])


def test_multi_input_structures():
    (x, y), x2 = _xy(6), RNG.normal(size=(6, 2, 2))
    got, _ = _all([((x, x2), y), ({"a": x, "b": [x2]}, y)])
    assert [b.n for b in got] == [6, 6]
    assert len(input_leaves(got[1].x)) == 2
    with pytest.raises(ValueError, match="different numbers of samples"):
        _all([((x, x2[:5]), y)])


def test_sample_weights_refused():
    x, y = _xy(4)
    with pytest.raises(TypeError, match="3 entries"):
        _all([(x, y, np.ones(4))])


@pytest.mark.parametrize("bad", [np.zeros((3, 2)), "xy", {"x": 1, "y": 2}, 5])
def test_data_that_is_not_batches(bad):
    with pytest.raises(TypeError, match="data must be one"):
        _all(bad)


def test_batch_of_wrong_types():
    x, y = _xy(4)
    with pytest.raises(TypeError, match=r"inputs x must be an array .* got a list of 4 entries holding float "
                                        r"values\. Convert nested Python lists of numbers to an array"):
        _all([(x.tolist(), y)])
    with pytest.raises(TypeError, match=r"got str\.$"):  # no hint where an entry is not a number
        _all([((x, "mask"), y)])
    with pytest.raises(TypeError, match="labels y must be an array"):
        _all([(x, list(y))])
    with pytest.raises(TypeError, match="every batch must be an"):
        _all([x])


class _Foreign:
    """Another framework's array: a shape, a dtype and ``__array__`` (as torch, TensorFlow and JAX
    arrays have), a read-only view like TensorFlow's."""

    def __init__(self, a):
        self._a = np.asarray(a)
        self.shape, self.dtype = self._a.shape, self._a.dtype

    def __array__(self, dtype=None, copy=None):
        view = self._a.view()
        view.flags.writeable = False
        return view


def test_another_frameworks_arrays_are_read_into_numpy():
    """Arrays the backend does not take but numpy reads (another framework's tensors) become writable
    numpy arrays, in every structure (one pair, a tuple of inputs, a named tuple, a mapping batch with
    its labels); the backend's own arrays and anything that is not an array stay as they are."""
    import collections

    x, y = _xy(4)
    (batch,), total = _all((_Foreign(x), _Foreign(y)))  # one pair
    assert total == 1 and isinstance(batch.x, np.ndarray) and batch.x.flags.writeable
    np.testing.assert_array_equal(batch.x, x)
    np.testing.assert_array_equal(batch.y, y)
    Inputs = collections.namedtuple("Inputs", "image mask")
    (batch,), _ = _all([(Inputs(_Foreign(x), x), y)])
    assert type(batch.x) is Inputs and isinstance(batch.x.image, np.ndarray) and batch.x.mask is x
    (batch,), _ = _all([{"input_ids": _Foreign(x), "labels": _Foreign(y)}])
    assert batch.keywords and isinstance(batch.x["input_ids"], np.ndarray) and isinstance(batch.y, np.ndarray)
    own = (x, y)
    (batch,), _ = _all([own])
    assert batch.x is x and batch.y is y  # nothing to read: the batch's own objects
    with pytest.raises(TypeError, match="got str"):
        _all([((x, "mask"), y)])


def test_no_data():
    with pytest.raises(ValueError, match="needs training data"):
        _all(None)


def test_mismatched_lengths():
    x, y = _xy(5)
    with pytest.raises(ValueError, match="5 inputs but 4 labels"):
        _all((x, y[:4]))


def test_scalars():
    x, y = _xy(3)
    with pytest.raises(ValueError, match="leading batch axis"):
        _all([(np.array(1.0), y)])
    with pytest.raises(ValueError, match="labels are a scalar"):
        _all([(x, np.array(1))])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs(bad):
    x, y = _xy(4)
    x2 = x.copy()
    x2[2, 1] = bad
    it, _ = batches([(x, y), (x2, y)], ADAPTER, validate_options())
    assert next(it).index == 0  # the check is per batch, when it is drawn
    with pytest.raises(ValueError, match="Batch 1: the inputs contain NaN"):
        next(it)


def test_integer_inputs_with_huge_values_are_fine():
    # Only floating inputs can be non-finite; integer token ids are not checked.
    got, _ = _all((np.full((3, 2), 2**62, dtype=np.int64), np.zeros(3, dtype=np.int64)))
    assert got[0].n == 3


def test_empty_batches_are_skipped_and_counted():
    (x1, y1), (x3, y3) = _xy(3), _xy(2)
    empty = (np.zeros((0, 3)), np.zeros(0, dtype=np.int64))
    got, total = _all([empty, (x1, y1), empty, (x3, y3), empty])
    assert total == 5
    assert [(b.index, b.n, b.offset) for b in got] == [(1, 3, 0), (3, 2, 3)]


def test_empty_batches_are_still_checked():
    with pytest.raises(ValueError, match="0 inputs but 1 labels"):
        _all([(np.zeros((0, 3)), np.zeros(1, dtype=np.int64))])


@pytest.mark.parametrize("data", [
    [], [(np.zeros((0, 3)), np.zeros(0, dtype=np.int64))] * 3, (np.zeros((0, 3)), np.zeros(0, dtype=np.int64)),
])
def test_all_empty_data(data):
    it, _ = batches(data, ADAPTER, validate_options())
    with pytest.raises(EmptyDataError, match="The data is empty"):
        list(it)
    assert issubclass(EmptyDataError, ValueError)  # the public API raises a ValueError


def test_infinite_data_needs_max_batches():
    data = Infinite(_xy(4))
    with pytest.raises(ValueError, match="max_batches"):
        _all(data)
    assert data.drawn == 0  # refused before drawing anything
    got, total = _all(data, max_batches=3)
    assert total == 3 and len(got) == 3 and data.drawn == 3
    assert [b.offset for b in got] == [0, 4, 8]


def test_max_batches_does_not_draw_one_more():
    drawn = []

    def gen():
        for i in range(10):
            drawn.append(i)
            yield _xy(2)

    got, total = _all(gen(), max_batches=3)
    assert total is None and len(got) == 3
    assert drawn == [0, 1, 2]


def test_max_batches_caps_the_known_total_and_counts_empty_batches():
    empty = (np.zeros((0, 3)), np.zeros(0, dtype=np.int64))
    got, total = _all([empty, _xy(2), _xy(2), _xy(2)], max_batches=2)
    assert total == 2
    assert [b.index for b in got] == [1]  # the empty batch is one of the two
    got, total = _all(_xy(5), max_batches=4)
    assert total == 1 and len(got) == 1


# ----------------------------------------------------------------------------- labels


def _labels(y, classes=4, loss="nsce", **options):
    y = np.asarray(y) if not isinstance(y, np.ndarray) else y
    batch = Batch(index=2, x=np.zeros((len(y), 1)), y=y, n=len(y), offset=0)
    if callable(loss):
        options.setdefault("estimator", "exact")
    return labels_for(batch, classes, ADAPTER, validate_options(loss=loss, **options))


def test_labels_indices():
    got = _labels(np.array([3, 0, 2], dtype=np.int32))
    assert got.dtype == np.int64 and got.tolist() == [3, 0, 2]
    assert _labels(np.array([1, 3], dtype=np.uint8)).tolist() == [1, 3]


def test_labels_column_vector():
    assert _labels(np.array([[1], [0], [3]])).tolist() == [1, 0, 3]


def test_labels_integer_valued_floats():
    assert _labels(np.array([1.0, 0.0, 3.0])).tolist() == [1, 0, 3]
    with pytest.raises(ValueError, match="integer class indices"):
        _labels(np.array([1.0, 0.5]))
    with pytest.raises(ValueError, match="integer class indices"):
        _labels(np.array([1.0, np.nan]))


def test_labels_one_hot():
    y = np.eye(4)[[2, 0, 3, 3]]
    assert _labels(y).tolist() == [2, 0, 3, 3]
    assert _labels(y.astype(np.int64)).tolist() == [2, 0, 3, 3]
    with pytest.raises(ValueError, match="model has 4 outputs"):
        _labels(np.eye(5)[[1, 2]])


@pytest.mark.parametrize("y", [
    [[0.9, 0.1, 0.0, 0.0]],  # smoothed
    [[0.5, 0.5, 0.0, 0.0]],  # soft
    [[1.0, 1.0, 0.0, 0.0]],  # multi-hot
    [[0.0, 0.0, 0.0, 0.0]],  # no class
])
def test_soft_labels_refused(y):
    with pytest.raises(ValueError, match="soft or smoothed labels are not supported"):
        _labels(np.array(y))


@pytest.mark.parametrize("y", [[0, 4], [-1, 2], [7]])
def test_labels_out_of_range(y):
    with pytest.raises(ValueError, match=r"Batch 2: labels must be class indices in \[0, 3\]"):
        _labels(np.array(y))


def test_bool_and_complex_labels_refused():
    with pytest.raises(TypeError, match="dtype bool"):
        _labels(np.array([True, False]))
    with pytest.raises(TypeError, match="complex"):
        _labels(np.array([1 + 0j, 0j]))


def test_labels_of_wrong_rank():
    with pytest.raises(ValueError, match="expected class indices of shape"):
        _labels(np.zeros((2, 4, 1), dtype=np.int64))


def test_custom_loss_gets_y_as_given_but_integer_labels_are_checked():
    def my_loss(logits, y):
        return (logits**2).mean()

    soft = np.array([[0.5, 0.5, 0.0, 0.0]])
    assert _labels(soft, loss=my_loss) is None  # soft targets are the custom loss's business
    assert _labels(np.array([0.5, 2.5]), loss=my_loss) is None  # regression targets too
    assert _labels(np.array([1, 3]), loss=my_loss).tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"class indices in \[0, 3\]"):
        _labels(np.array([1, 4]), loss=my_loss)


class _TorchLikeDtype:
    """A dtype without ``name`` that prints as ``torch.float64`` does."""

    def __str__(self):
        return "torch.float64"


class _Array:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def test_describe_inputs_names_dtypes_and_shapes():
    """Arrays by dtype and shape; a mapping's by name, a tuple's by position, the first four then a count."""
    assert describe_inputs(np.zeros((8, 7))) == "float64 (8, 7)"
    assert describe_inputs(_Array((2, 3), _TorchLikeDtype())) == "float64 (2, 3)"
    assert describe_inputs({"input_ids": np.zeros((2, 5), np.int64), "mask": np.ones((2, 5), bool)}) == (
        "input_ids int64 (2, 5), mask bool (2, 5)")
    six = tuple(np.zeros((1, i), np.float32) for i in range(6))
    assert describe_inputs(six) == ("[0] float32 (1, 0), [1] float32 (1, 1), [2] float32 (1, 2), "
                                    "[3] float32 (1, 3) and 2 more")


def test_model_fails_on_inputs_message():
    batch = Batch(index=3, x={"input_ids": np.zeros((2, 5), np.int64)}, y=np.zeros(2), n=2, offset=0, keywords=True)
    err = model_fails_on_inputs("keras", RuntimeError("\x1b[1mshapes do not match\x1b[0m"), batch)
    assert isinstance(err, ValueError)
    assert str(err).startswith("The keras model fails on the inputs of batch 3 (input_ids int64 (2, 5), as keyword "
                               "arguments): RuntimeError: shapes do not match. normflat calls the model")


def test_raised_by_normflat_tells_its_own_errors_from_the_models():
    """An error raised by a ``raise`` in normflat's code is its own. One raised outside it (the model),
    or by a builtin that normflat's code calls (as a framework's error whose frames are filtered out
    ends at normflat's call of the model), is not; nor is one never raised."""
    from normflat.engine import losses

    with pytest.raises(ValueError) as own:
        losses.check_samples_apart(np.array([[0.0, 1.0]]), [np.array([[0.0, 5.0]])])
    assert raised_by_normflat(own.value)

    def model(x):
        raise RuntimeError("the model's own error")

    with pytest.raises(RuntimeError) as outside:
        model(None)
    assert not raised_by_normflat(outside.value)
    with pytest.raises(ValueError) as through:
        describe_inputs(_Array((1, "x"), np.float64))  # int("x") fails on a line of normflat's that calls it
    assert through.value.__traceback__ is not None and not raised_by_normflat(through.value)
    assert not raised_by_normflat(RuntimeError("never raised"))
