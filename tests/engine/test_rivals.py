"""The engine's rival measures and PAC-Bayes bound (method §10) against brute force,
on a numpy ReLU MLP with exact hand-written gradients (tests/engine/_numpy_model.py)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import optimize

from normflat.engine import rivals
from normflat.engine.rivals import MeasureSettings, compute_measures, kl_upper_inverse
from tests.engine._numpy_model import NumpyMLP, random_mlp, rescaled


def _measure(model, names, seed=0, layers=None, **settings):
    return compute_measures(model, rivals.validate_measure_names(names),
                            MeasureSettings.from_overrides(None, settings), seed=seed, layers=layers)


def test_worst_case_linf_is_the_best_vertex_of_a_convex_loss():
    # A linear softmax model's cross-entropy is convex in W, so its maximum over the box
    # |delta| <= rho |w| is at a vertex: enumerate all 2^6 of them.
    params, x, y = random_mlp(seed=1, d=2, classes=3, linear=True, n=20)
    model = NumpyMLP(params, x, y)
    rho = 0.05
    report = _measure(model, ["adaptive_sharpness"], rho=rho, steps=20)
    w = params["W1"]
    base = float(np.mean(model.evaluate(None)[0]))
    best = max(float(np.mean(model.evaluate([rho * np.abs(w) * np.array(s).reshape(w.shape)])[0]))
               for s in itertools.product((-1.0, 1.0), repeat=w.size))
    assert report.adaptive_sharpness == pytest.approx(best - base, rel=1e-12)
    assert report.adaptive_sharpness > 0


def test_worst_case_l2_matches_a_constrained_optimizer():
    params, x, y = random_mlp(seed=2, d=2, classes=3, linear=True, n=20)
    model = NumpyMLP(params, x, y)
    rho = 0.1
    report = _measure(model, ["adaptive_sharpness"], rho=rho, norm="l2", steps=60)
    w = params["W1"]
    a = np.abs(w).ravel()

    def neg(e):
        return -float(np.mean(model.evaluate([(a * e).reshape(w.shape)])[0]))

    best = -min((optimize.minimize(neg, rho * s / np.linalg.norm(s), method="SLSQP",
                                   constraints=[{"type": "ineq", "fun": lambda e: rho ** 2 - e @ e}],
                                   options={"ftol": 1e-14, "maxiter": 500}).fun
                 for s in np.random.default_rng(0).normal(size=(8, w.size))))
    base = float(np.mean(model.evaluate(None)[0]))
    assert report.adaptive_sharpness == pytest.approx(best - base, rel=1e-3)
    assert report.adaptive_sharpness <= best - base + 1e-12  # PGA stays inside the ball


def test_average_case_is_the_mean_over_the_documented_draws():
    params, x, y = random_mlp(seed=3)
    model = NumpyMLP(params, x, y)
    report = _measure(model, ["average_adaptive_sharpness"], seed=7, average_rho=0.2, average_draws=5)
    rng = np.random.default_rng(np.random.SeedSequence([7, 1]))
    base = float(np.mean(model.evaluate(None)[0]))
    inc = []
    for _ in range(5):
        xi = [rng.standard_normal(w.shape) for w in model.weights()]
        inc.append(float(np.mean(model.evaluate([0.2 * np.abs(w) * z for w, z in zip(model.weights(), xi)])[0])) - base)
    assert report.average_adaptive_sharpness == pytest.approx(np.mean(inc), rel=1e-12)
    assert report.standard_errors["average_adaptive_sharpness"] == pytest.approx(np.std(inc, ddof=1) / math.sqrt(5),
                                                                                rel=1e-12)


def test_magnitude_aware_scale_solves_the_target_equation():
    params, x, y = random_mlp(seed=4)
    model = NumpyMLP(params, x, y)
    target = 0.05
    report = _measure(model, ["magnitude_aware_sharpness"], target=target, epsilon=1e-3, magnitude_draws=4,
                      bisections=50)
    rng = np.random.default_rng(np.random.SeedSequence([0, 2]))
    draws = [[rng.standard_normal(w.shape) for w in model.weights()] for _ in range(4)]
    base = float(np.mean(model.evaluate(None)[0]))

    def increase(alpha):
        return np.mean([np.mean(model.evaluate([np.sqrt(alpha ** 2 * w ** 2 + 1e-6) * z
                                                for w, z in zip(model.weights(), xi)])[0]) for xi in draws]) - base

    alpha = optimize.brentq(lambda a: increase(a) - target, 1e-6, 10.0, xtol=1e-14)
    assert report.magnitude_aware_sharpness == pytest.approx(1.0 / alpha, rel=1e-8)
    assert report.details["magnitude_aware_sharpness"]["alpha"] == pytest.approx(alpha, rel=1e-8)


def test_fisher_rao_norm_and_norm_products_against_brute_force():
    params, x, y = random_mlp(seed=5)
    model = NumpyMLP(params, x, y)
    report = _measure(model, ["fisher_rao_norm", "log_spectral_norm_product", "log_frobenius_norm_product",
                              "path_norm"])
    # <w, grad loss_i> by central differences of loss_i(W (1 + t)).
    t = 1e-6
    up = model.evaluate([t * w for w in model.weights()])[0]
    down = model.evaluate([-t * w for w in model.weights()])[0]
    fd = (up - down) / (2 * t)
    assert report.fisher_rao_norm == pytest.approx(math.sqrt(np.mean(fd ** 2)), rel=1e-7)
    svals = [np.linalg.svd(w, compute_uv=False) for w in model.weights()]
    assert report.log_spectral_norm_product == pytest.approx(sum(math.log(s[0]) for s in svals), rel=1e-13)
    assert report.log_frobenius_norm_product == pytest.approx(
        sum(0.5 * math.log(float(np.sum(s * s))) for s in svals), rel=1e-13)
    # Path norm: the explicit sum over input->hidden->output paths of prod w^2, plus bias paths.
    W1, b1, W2, b2 = (params[k] for k in ("W1", "b1", "W2", "b2"))
    paths = sum(W2[c, h] ** 2 * W1[h, i] ** 2 for c in range(W2.shape[0]) for h in range(W2.shape[1])
                for i in range(W1.shape[1]))
    paths += sum(W2[c, h] ** 2 * b1[h] ** 2 for c in range(W2.shape[0]) for h in range(W2.shape[1]))
    paths += float(np.sum(b2 ** 2))
    assert report.path_norm == pytest.approx(math.sqrt(paths), rel=1e-13)


def test_the_scale_invariant_measures_survive_a_unit_wise_rescaling():
    params, x, y = random_mlp(seed=6, n=30)
    a, b = NumpyMLP(params, x, y), NumpyMLP(rescaled(params), x, y)
    assert np.allclose(a._forward(None)[1], b._forward(None)[1], rtol=1e-12, atol=1e-12)
    names = ["adaptive_sharpness", "average_adaptive_sharpness", "fisher_rao_norm", "path_norm",
             "magnitude_aware_sharpness", "log_spectral_norm_product", "log_frobenius_norm_product"]
    exact = dict(epsilon=0.0, magnitude_draws=3, bisections=30, average_draws=4, rho=0.02)
    ra, rb = _measure(a, names, **exact), _measure(b, names, **exact)
    for name in ("adaptive_sharpness", "average_adaptive_sharpness", "fisher_rao_norm", "path_norm",
                 "magnitude_aware_sharpness"):
        assert rivals.INVARIANT[name]
        assert rb.values[name] == pytest.approx(ra.values[name], rel=1e-8), name
    for name in ("log_spectral_norm_product", "log_frobenius_norm_product"):
        assert not rivals.INVARIANT[name]
        assert abs(rb.values[name] - ra.values[name]) > 0.1, name
    # The published noise floor epsilon = 1e-3 is not scale invariant: it moves.
    fa = _measure(a, ["magnitude_aware_sharpness"], epsilon=0.05, magnitude_draws=3)
    fb = _measure(b, ["magnitude_aware_sharpness"], epsilon=0.05, magnitude_draws=3)
    assert abs(fb.magnitude_aware_sharpness / fa.magnitude_aware_sharpness - 1) > 1e-3


def test_kl_inverse_against_a_root_finder():
    for q, c in [(0.0, 0.3), (0.1, 0.05), (0.5, 0.01), (0.93, 0.2)]:
        def kl(p):
            return (q * math.log(q / p) if q > 0 else 0.0) + (1 - q) * math.log((1 - q) / (1 - p)) - c
        ref = optimize.brentq(kl, q + 1e-15, 1 - 1e-15, xtol=1e-15)
        assert kl_upper_inverse(q, c) == pytest.approx(ref, abs=1e-11)
    assert kl_upper_inverse(0.2, 0.0) == 0.2
    assert kl_upper_inverse(1.0, 0.5) == 1.0


def _layers_for(model, seed=0):
    """LayerResult-like objects with positive sigmas, as analyze returns them."""
    rng = np.random.default_rng(seed)
    out = []
    for name, w in zip(model.names, model.weights()):
        out.append(SimpleNamespace(name=name, shape=w.shape, row_sigma=np.exp(rng.normal(size=w.shape[0]) - 3),
                                   col_sigma=np.exp(rng.normal(size=w.shape[1]))))
    out[0].row_sigma[0] = np.inf  # a degenerate row: clipped to the grid's end
    return out


def test_bound_equals_the_formula_over_every_lambda():
    params, x, y = random_mlp(seed=7, n=40)
    model = NumpyMLP(params, x, y)
    layers = _layers_for(model)
    s = MeasureSettings(bound_draws=6, lambda_grid=12).validate()
    report = compute_measures(model, rivals.BOUND_MEASURES, s, seed=3, layers=layers)
    m = 40
    points = 2 * int(s.grid_range / s.grid_step) + 1
    ln_prior = sum(w.shape[0] + w.shape[1] for w in model.weights()) * math.log(points)
    lambdas = [2.0 ** k for k in range(13)]
    cap = math.log(1 / s.probability_floor)

    def on_grid(v):
        v = np.clip(np.nan_to_num(v, posinf=s.grid_range, neginf=-s.grid_range), -s.grid_range, s.grid_range)
        return np.round(v / s.grid_step) * s.grid_step

    totals = {"pac_bayes_bound": [], "pac_bayes_bound_surrogate": []}
    rng = np.random.default_rng(np.random.SeedSequence([3, 3]))
    # Brute force: every lambda, in the order the engine draws (by deterministic part).
    rows = []
    for lam in lambdas:
        log_v = [on_grid(np.log(l.row_sigma) - 0.5 * math.log(lam))[:, None] + on_grid(np.log(l.col_sigma))[None, :]
                 for l in layers]
        kl = sum(float(np.sum(w ** 2 / np.exp(lv))) / 2 for w, lv in zip(model.weights(), log_v))
        det = (kl + ln_prior + math.log(len(lambdas) / s.bound_delta)) / lam + lam / (8 * m)
        rows.append((det, lam, log_v))
    rows.sort(key=lambda r: (r[0], r[1]))
    for det, lam, log_v in rows:
        err, sur = [], []
        for _ in range(6):
            xi = [rng.standard_normal(w.shape) for w in model.weights()]
            losses, correct = model.evaluate([np.exp(0.5 * lv) * z for lv, z in zip(log_v, xi)])
            err.append(1 - np.mean(correct))
            sur.append(np.mean(np.minimum(losses, cap)) / cap)
        rate = math.log(len(lambdas) / s.bound_mc_delta) / 6
        totals["pac_bayes_bound"].append(kl_upper_inverse(float(np.mean(err)), rate) + det)
        totals["pac_bayes_bound_surrogate"].append(kl_upper_inverse(float(np.mean(sur)), rate) + det)
        # The engine stops once the deterministic part exceeds both best totals: the
        # brute force below checks the pruned candidates could not have won.
    for name, values in totals.items():
        assert report.values[name] == pytest.approx(min(values), rel=1e-12), name
        assert report.details[name]["vacuous"] == (min(values) >= 1)
        assert report.values[name] >= report.details[name]["posterior_loss_estimate"]


def test_bound_needs_the_layers_of_the_same_model():
    params, x, y = random_mlp(seed=8, n=30)
    model = NumpyMLP(params, x, y)
    with pytest.raises(ValueError, match="optimal variances of normalized sharpness"):
        compute_measures(model, ("pac_bayes_bound",), MeasureSettings(), seed=0, layers=None)


def test_settings_are_validated_with_the_fix():
    with pytest.raises(TypeError, match="Unknown measure setting"):
        MeasureSettings.from_overrides(None, {"rhoo": 1})
    with pytest.raises(ValueError, match="'linf' or 'l2'"):
        MeasureSettings.from_overrides(None, {"norm": "l1"})
    with pytest.raises(ValueError, match="rho must be a finite number > 0"):
        MeasureSettings.from_overrides(None, {"rho": -1.0})
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        MeasureSettings.from_overrides(None, {"bound_delta": 1.5})
    with pytest.raises(ValueError, match="Unknown measure"):
        rivals.validate_measure_names(["sharpness"])
    assert rivals.validate_measure_names(["path_norm", "adaptive_sharpness"]) == ("adaptive_sharpness", "path_norm")


def test_report_reads_values_as_attributes_and_serializes():
    params, x, y = random_mlp(seed=9)
    report = _measure(NumpyMLP(params, x, y), ["path_norm", "average_adaptive_sharpness"], average_draws=3)
    assert report.path_norm == report["path_norm"] == report.values["path_norm"]
    with pytest.raises(AttributeError, match="was not computed"):
        report.fisher_rao_norm
    data = report.to_dict()
    assert set(data["values"]) == {"path_norm", "average_adaptive_sharpness"}
    assert "path norm" in str(report)
