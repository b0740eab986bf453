"""LayerProblem validation, the framework-free analyze() path and dispatch errors."""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from normflat.engine.options import validate_options


def test_layer_problem_holds_canonical_arrays():
    w, h = np.ones((3, 2, 2)), np.ones((3, 2, 2))
    p = normflat.LayerProblem("conv", w, h, kind="conv1d")
    assert p.shape == (3, 2, 2) and p.kind == "conv1d"
    with pytest.raises(AttributeError):
        p.name = "other"  # frozen


@pytest.mark.parametrize(
    "weight, hdiag, exc, match",
    [
        (np.ones((2, 3)), np.ones((3, 2)), ValueError, r"'L'.*shape \(2, 3\).*\(3, 2\) differ"),
        (np.ones(3), np.ones(3), ValueError, r"'L'.*at least 2 dimensions"),
        (np.ones((2, 3), dtype=int), np.ones((2, 3)), TypeError, r"'L'.*weight has dtype int64.*floating"),
        (np.ones((2, 3)), np.ones((2, 3), dtype=np.int32), TypeError, r"hessian_diag has dtype int32"),
        (np.array([[1.0, np.nan]]), np.ones((1, 2)), ValueError, r"'L'.*weight contains NaN or infinite"),
        (np.ones((1, 2)), np.array([[1.0, np.inf]]), ValueError, r"hessian_diag contains NaN or infinite"),
        ([[1.0, 2.0]], np.ones((1, 2)), TypeError, r"weight must be an array"),
        (np.ones((0, 2)), np.ones((0, 2)), ValueError, r"empty axis"),
        (np.ones((2, 2), dtype=complex), np.ones((2, 2)), TypeError, r"real floating"),
    ],
)
def test_layer_problem_rejects_bad_input(weight, hdiag, exc, match):
    with pytest.raises(exc, match=match):
        normflat.LayerProblem("L", weight, hdiag)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_finite_check_from_the_sum_and_exactly_where_it_overflows(library, dtype):
    """The finiteness check reads a finite sum as all finite; a non-finite one (a NaN, an
    infinity, opposite infinities, or finite entries whose sum overflows) takes the exact check,
    without a warning."""
    import warnings

    xp = pytest.importorskip(library)
    big = float(np.finfo(dtype).max) / 2

    def array(values):
        return xp.asarray(np.array(values, dtype=dtype).reshape(2, 2))

    ones = array([1.0] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normflat.LayerProblem("L", array([big] * 4), ones)  # the sum overflows: exact, finite
        normflat.LayerProblem("L", array([big, big, -big, -big]), ones)
        for bad in ([1.0, np.nan, 1.0, 1.0], [1.0, np.inf, 1.0, 1.0], [np.inf, -np.inf, 1.0, 1.0],
                    [big, big, np.nan, 1.0]):
            with pytest.raises(ValueError, match="'L'.*weight contains NaN or infinite"):
                normflat.LayerProblem("L", array(bad), ones)
            with pytest.raises(ValueError, match="samples contains NaN or infinite"):
                normflat.LayerProblem("L", ones, ones, hessian_diag_samples=xp.stack([array(bad), ones]))


def test_layer_problem_rejects_bad_samples():
    with pytest.raises(ValueError, match=r"hessian_diag_samples has shape \(1, 2, 2\)"):
        normflat.LayerProblem("L", np.ones((2, 2)), np.ones((2, 2)), hessian_diag_samples=np.ones((1, 2, 2)))
    # A kernel: the full samples or their kernel sums, nothing in between.
    w = np.ones((2, 3, 3, 3))
    normflat.LayerProblem("C", w, w, hessian_diag_samples=np.full((4, 2, 3, 1, 1), 9.0))
    with pytest.raises(ValueError, match=r"expected \(K, 2, 3, 3, 3\) or their kernel sums \(K, 2, 3, 1, 1\)"):
        normflat.LayerProblem("C", w, w, hessian_diag_samples=np.ones((4, 2, 3, 3, 1)))
    # Kernel sums are checked against the diagonal's kernel sums.
    with pytest.raises(ValueError, match="must be the mean"):
        normflat.LayerProblem("C", w, w, hessian_diag_samples=np.ones((4, 2, 3, 1, 1)))


def test_analyze_layer_problems_sums_layers():
    rng = np.random.default_rng(0)
    problems = [
        normflat.LayerProblem("fc1", rng.normal(size=(4, 3)), rng.random((4, 3))),
        normflat.LayerProblem("conv", rng.normal(size=(2, 3, 3, 3)), rng.normal(size=(2, 3, 3, 3)), kind="conv2d"),
    ]
    report = normflat.analyze(problems)
    singles = [normflat.normalized_sharpness(p.weight, p.hessian_diag) for p in problems]
    for measure in normflat.MEASURES:
        assert getattr(report, measure) == pytest.approx(sum(getattr(s, measure) for s in singles), rel=1e-14)
    assert [layer.name for layer in report.layers] == ["fc1", "conv"]
    assert report.layer("conv").kind == "conv2d"
    with pytest.raises(KeyError, match="No layer named 'nope'"):
        report.layer("nope")


def test_analyze_empty_list_and_bad_items():
    with pytest.raises(ValueError, match="empty list of layer problems"):
        normflat.analyze([])
    with pytest.raises(TypeError, match="cannot analyze an object of type builtins.list"):
        normflat.analyze([np.ones((2, 2))], None)
    p = normflat.LayerProblem("x", np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(TypeError, match="expects LayerProblem items in its list, got ndarray"):
        normflat.analyze([p, np.ones((2, 2))])


def test_duplicate_layer_names_rejected():
    p = normflat.LayerProblem("x", np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"unique; repeated: \['x'\]"):
        normflat.analyze([p, p])


def test_unknown_model_type():
    with pytest.raises(TypeError, match="cannot analyze an object of type builtins.str"):
        normflat.analyze("model.pt", data=[(1, 2)])


def test_model_without_data():
    from normflat import backends

    class Fake:
        pass

    saved = backends.registered_backends()
    try:
        normflat.register_backend("fake", "tests.core.fake_backend", lambda m: isinstance(m, Fake))
        with pytest.raises(ValueError, match="needs training data"):
            normflat.analyze(Fake())
    finally:
        backends._REGISTRY[:] = saved


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"estimator": "fisher"}, ValueError, "Unknown estimator 'fisher'; choose one of 'auto', 'ggn'"),
        ({"loss": "mse"}, ValueError, "Unknown loss 'mse'"),
        ({"loss": 3}, TypeError, "loss must be"),
        ({"loss": lambda z, y: z.sum(), "estimator": "ggn"}, ValueError, "With a custom loss callable use"),
        ({"on_unsupported": "ignore"}, ValueError, "on_unsupported='ignore'"),
        ({"samples": 0, "estimator": "hutchinson"}, ValueError, "samples must be >= 1"),
        ({"samples": 2.5, "estimator": "hutchinson"}, TypeError, "samples must be a positive int"),
        ({"max_batches": 0}, ValueError, "max_batches"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"seed": "x"}, TypeError, "seed must be an int"),
    ],
)
def test_option_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        validate_options(**kwargs)


def test_option_defaults():
    assert validate_options(estimator="hutchinson").samples == 100
    assert validate_options(estimator="ggn-mc").samples == 1
    # samples means nothing to a deterministic estimator: refused, not silently dropped.
    with pytest.raises(ValueError, match="no meaning for the deterministic estimator 'ggn'"):
        validate_options(estimator="ggn", samples=5)
    assert validate_options(loss=lambda z, y: z, estimator="exact").loss_name == "<lambda>"


def test_register_backend_detects_first():
    from normflat import backends

    class MyModel:
        pass

    saved = backends.registered_backends()
    try:
        normflat.register_backend("mine", "tests.core.fake_backend", lambda m: isinstance(m, MyModel), first=True)
        report = normflat.analyze(MyModel(), data=[(np.ones(2), np.zeros(2))], progress=False)
        assert report.metadata["framework"] == "mine"
        assert report.metadata["examples"] == 2
        assert report.layers[0].name == "fake"
        diag = normflat.hessian_diagonal(MyModel(), [(np.ones(2), np.zeros(2))])
        assert list(diag) == ["fake"]
    finally:
        backends._REGISTRY[:] = saved
