"""The rival generalization measures and the PAC-Bayes bound (method §10), written once.

Every algorithm here works on a backend's
:class:`~normflat.engine.perturbation.PerturbationModel` through numpy arrays in
the canonical layout, so a measure means the same thing, and with the same seed
gives the same number, in every framework. The randomness is normflat's own
(:func:`_generator`), never the global RNG; a measure that draws noise draws the
same noise (common random numbers) for every model with the same layer shapes,
which is what makes the scale-invariant measures exactly invariant under a
function-preserving rescaling (method §10.5).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Sequence

import numpy as np

from normflat.engine.perturbation import PerturbationModel, UnsupportedMeasureError

__all__ = [
    "RIVAL_MEASURES",
    "RIVAL_LABELS",
    "BOUND_MEASURES",
    "MeasureSettings",
    "MeasuresReport",
    "compute_measures",
    "validate_measure_names",
    "json_ready",
    "kl_upper_inverse",
    "hyperprior_grid",
    "posterior_log_variances",
    "INVARIANT",
    "UnsupportedMeasureError",
    "norm_products",
    "pac_bayes_bounds",
    "worst_adaptive_sharpness",
    "average_adaptive_sharpness",
    "magnitude_aware_sharpness",
]

#: Measure names, in report order (method §10).
RIVAL_MEASURES = (
    "adaptive_sharpness",
    "average_adaptive_sharpness",
    "magnitude_aware_sharpness",
    "fisher_rao_norm",
    "path_norm",
    "log_spectral_norm_product",
    "log_frobenius_norm_product",
    "pac_bayes_bound",
    "pac_bayes_bound_surrogate",
)
#: Human-readable names (tables, figures).
RIVAL_LABELS = {
    "adaptive_sharpness": "adaptive sharpness (worst case)",
    "average_adaptive_sharpness": "adaptive sharpness (average)",
    "magnitude_aware_sharpness": "magnitude-aware PAC-Bayes 1/α'",
    "fisher_rao_norm": "Fisher–Rao norm",
    "path_norm": "path norm",
    "log_spectral_norm_product": "log Π spectral norms",
    "log_frobenius_norm_product": "log Π Frobenius norms",
    "pac_bayes_bound": "PAC-Bayes bound (0-1 loss)",
    "pac_bayes_bound_surrogate": "PAC-Bayes bound (surrogate)",
}
#: The two bound values: they need the optimal variances of normalized sharpness.
BOUND_MEASURES = ("pac_bayes_bound", "pac_bayes_bound_surrogate")
#: Which measures method §10.5 says are invariant to the study's function-preserving
#: rescalings (unit-wise ReLU rescaling, rescaling before BatchNorm, layer-wise
#: rescaling): ``True`` exactly, ``"approx"`` up to a small documented term.
INVARIANT = {
    "adaptive_sharpness": True,
    "average_adaptive_sharpness": True,
    "magnitude_aware_sharpness": "approx",  # exactly only with epsilon = 0
    "fisher_rao_norm": True,
    "path_norm": True,
    "log_spectral_norm_product": False,
    "log_frobenius_norm_product": False,
    "pac_bayes_bound": "approx",  # up to the rounding to the hyperprior grid
    "pac_bayes_bound_surrogate": "approx",
}


@dataclass(frozen=True)
class MeasureSettings:
    """Settings of the rival measures (method §10); every field can also be passed to
    :func:`normflat.measures` as a keyword argument.

    Attributes:
        rho: Radius of the worst-case adaptive perturbation ``|delta| <= rho |w|``
            (``norm="linf"``) or ``||delta / |w|||_2 <= rho`` (``norm="l2"``).
        norm: ``"linf"`` or ``"l2"``: the ball of the worst-case adaptive sharpness.
        steps: Projected gradient-ascent steps of the worst case.
        average_rho: Relative noise scale of the average case: ``delta ~ N(0, (rho |w|)^2)``.
        average_draws: Noise draws of the average case.
        target: Loss increase that defines the magnitude-aware noise scale ``alpha'``.
        epsilon: Absolute noise floor of the magnitude-aware perturbation,
            ``u ~ N(0, alpha^2 w^2 + epsilon^2)`` (Jiang et al. use ``1e-3``; only
            ``0`` makes the measure exactly scale invariant).
        magnitude_draws: Noise draws per trial scale of the magnitude-aware search.
        bisections: Bisection steps of the magnitude-aware search (in ``log alpha``).
        bound_delta: Confidence ``delta`` of the PAC-Bayes bound.
        bound_mc_delta: Confidence ``delta'`` of the Monte Carlo estimate of the
            posterior's training loss; the bound holds with probability at least
            ``1 - delta - delta'``.
        bound_draws: Posterior draws per candidate ``lambda``.
        grid_step: Spacing ``Delta`` of the hyperprior grid of log standard scales
            (natural log).
        grid_range: The grid covers ``[-grid_range, grid_range]``.
        lambda_grid: Exponents ``k`` of the candidate ``lambda = 2^k``: ``0..lambda_grid``.
        probability_floor: ``p_min`` of the bounded surrogate loss
            ``min(loss, ln(1/p_min)) / ln(1/p_min)``.
    """

    rho: float = 0.01
    norm: str = "linf"
    steps: int = 20
    average_rho: float = 0.05
    average_draws: int = 20
    target: float = 0.1
    epsilon: float = 1e-3
    magnitude_draws: int = 10
    bisections: int = 20
    bound_delta: float = 0.025
    bound_mc_delta: float = 0.01
    bound_draws: int = 100
    grid_step: float = 0.5
    grid_range: float = 25.0
    lambda_grid: int = 40
    probability_floor: float = 1e-4

    def validate(self) -> "MeasureSettings":
        """Check every field, naming the fix.

        Raises:
            ValueError: For an out-of-range value.
            TypeError: For a value of the wrong type.
        """
        for name in ("rho", "average_rho", "target", "grid_step", "grid_range"):
            _positive_float(name, getattr(self, name))
        if not isinstance(self.epsilon, (int, float)) or isinstance(self.epsilon, bool) or not (
                math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}.")
        for name in ("steps", "average_draws", "magnitude_draws", "bisections", "bound_draws", "lambda_grid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a positive int, got {value!r}.")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.norm not in ("linf", "l2"):
            raise ValueError(f"Unknown norm {self.norm!r} for the adaptive sharpness; choose 'linf' or 'l2'.")
        for name in ("bound_delta", "bound_mc_delta", "probability_floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
                raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}.")
        if self.bound_delta + self.bound_mc_delta >= 1:
            raise ValueError("bound_delta + bound_mc_delta must be < 1: the bound holds with probability "
                             f"1 - {self.bound_delta} - {self.bound_mc_delta}.")
        return self

    @classmethod
    def from_overrides(cls, settings: "MeasureSettings | None", overrides: dict[str, Any]) -> "MeasureSettings":
        """``settings`` (default: the defaults) with the fields named in ``overrides`` replaced.

        Raises:
            TypeError: For a keyword that is not a field, naming the fields.
        """
        base = settings if settings is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"settings must be a normflat.MeasureSettings, got {type(base).__name__}.")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"Unknown measure setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(sorted(names))}.")
        return replace(base, **overrides).validate()


def _positive_float(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


def validate_measure_names(names: Sequence[str] | str | None) -> tuple[str, ...]:
    """The requested measures in report order (``None``: all of them).

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    if names is None:
        return RIVAL_MEASURES
    if isinstance(names, str):
        names = (names,)
    unknown = [n for n in names if n not in RIVAL_MEASURES]
    if unknown:
        raise ValueError(f"Unknown measure(s) {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(RIVAL_MEASURES)}.")
    return tuple(n for n in RIVAL_MEASURES if n in set(names))


@dataclass
class MeasuresReport:
    """The rival measures of one model (method §10).

    Attributes:
        values: ``{measure: value}`` for the measures computed, in report order.
        standard_errors: ``{measure: standard error}`` of the Monte Carlo estimates
            (the average-case adaptive sharpness).
        details: Per measure, how it was obtained (the worst case's ascent, the
            magnitude-aware scale ``alpha'``, the bound's terms, ``lambda`` and whether
            it is vacuous).
        settings: The :class:`MeasureSettings` used (as a dict).
        metadata: Framework, loss, number of predictions, layers, seed.
    """

    values: dict[str, float]
    standard_errors: dict[str, float] = field(default_factory=dict)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> float:
        # Measure values read as attributes (report.path_norm), like Report's totals.
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}"
            + (f"; {name!r} was not computed (pass measures=[..., {name!r}])" if name in RIVAL_MEASURES else ""))

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite numbers become ``None``)."""
        return json_ready(asdict(self))

    def to_json(self, path: Any = None) -> str:
        """Strict JSON; also written to ``path`` if given."""
        import json

        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    def __str__(self) -> str:
        lines = [f"normflat measures ({self.metadata.get('framework')}, loss={self.metadata.get('loss')}, "
                 f"{self.metadata.get('predictions')} predictions)"]
        for name, value in self.values.items():
            se = self.standard_errors.get(name)
            text = f"{value:.6g}" + (f" ± {se:.2g}" if se is not None else "")
            note = " (vacuous)" if self.details.get(name, {}).get("vacuous") else ""
            lines.append(f"  {RIVAL_LABELS[name]:<36} {text}{note}")
        return "\n".join(lines)


def json_ready(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python values and non-finite floats as
    ``None`` (strict JSON), recursively through dicts, lists and tuples."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_ready(value.tolist())
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


# --------------------------------------------------------------------------- randomness

#: Streams of normflat's generator, one per measure, so adding a measure never changes
#: another's noise.
_STREAMS = {"average": 1, "magnitude": 2, "bound": 3}


def _generator(seed: int, stream: str) -> np.random.Generator:
    """normflat's own generator for one measure (never the global RNG)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, _STREAMS[stream]]))


def _standard_normals(rng: np.random.Generator, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    return [rng.standard_normal(shape) for shape in shapes]


# --------------------------------------------------------------------------- the measures


class _Evaluator:
    """Mean losses at perturbed weights, counting passes over the data."""

    def __init__(self, model: PerturbationModel, tick: Callable[[], None]) -> None:
        self.model = model
        self.tick = tick
        losses, correct = model.evaluate(None)
        self.predictions = int(losses.shape[0])
        self.base_loss = float(np.mean(losses))
        self.base_error = float(1.0 - np.mean(correct))
        self.passes = 1

    def evaluate(self, deltas: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        losses, correct = self.model.evaluate(deltas)
        self.passes += 1
        self.tick()
        return losses, correct

    def mean_loss(self, deltas: list[np.ndarray]) -> float:
        return float(np.mean(self.evaluate(deltas)[0]))

    def gradient(self, deltas: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        result = self.model.gradient(deltas)
        self.passes += 1
        self.tick()
        return result


def worst_adaptive_sharpness(ev: _Evaluator, weights: list[np.ndarray], s: MeasureSettings) -> tuple[float, dict]:
    """``max_{||delta/|w|||_p <= rho} L(w + delta) - L(w)`` by projected gradient ascent.

    Ascends in the adaptive coordinates ``eps = delta / |w|`` from ``eps = 0``: the
    gradient there is ``|w| * grad_w L``, which a function-preserving rescaling of the
    weights leaves unchanged, so the whole ascent path is rescaling invariant
    (method §10.1). Steps of size ``2.5 rho / steps`` (sign steps for ``linf``,
    normalized steps for ``l2``), projected onto the ball; the value is the largest
    loss seen along the path.
    """
    scale = [np.abs(w) for w in weights]
    eps = [np.zeros_like(w) for w in weights]
    step = 2.5 * s.rho / s.steps
    best = ev.base_loss
    losses = []
    for _ in range(s.steps):
        loss, grads = ev.gradient([a * e for a, e in zip(scale, eps)])
        losses.append(loss)
        best = max(best, loss)
        ascent = [a * g for a, g in zip(scale, grads)]
        if s.norm == "linf":
            eps = [np.clip(e + step * np.sign(g), -s.rho, s.rho) for e, g in zip(eps, ascent)]
        else:
            norm = math.sqrt(sum(float(np.sum(g * g)) for g in ascent))
            if norm == 0.0:
                break  # a stationary point of the adaptive problem: no ascent direction
            eps = [e + (step / norm) * g for e, g in zip(eps, ascent)]
            radius = math.sqrt(sum(float(np.sum(e * e)) for e in eps))
            if radius > s.rho:
                eps = [e * (s.rho / radius) for e in eps]
    final = ev.mean_loss([a * e for a, e in zip(scale, eps)])
    losses.append(final)
    best = max(best, final)
    return best - ev.base_loss, {"base_loss": ev.base_loss, "worst_loss": best, "ascent_losses": losses,
                                 "rho": s.rho, "norm": s.norm, "steps": s.steps}


def average_adaptive_sharpness(ev: _Evaluator, weights: list[np.ndarray], s: MeasureSettings,
                               seed: int) -> tuple[float, float, dict]:
    """``E_{xi ~ N(0, I)} L(w + rho |w| xi) - L(w)``, with its Monte Carlo standard error."""
    rng = _generator(seed, "average")
    shapes = [w.shape for w in weights]
    increases = []
    for _ in range(s.average_draws):
        xi = _standard_normals(rng, shapes)
        increases.append(ev.mean_loss([s.average_rho * np.abs(w) * z for w, z in zip(weights, xi)]) - ev.base_loss)
    inc = np.asarray(increases)
    se = float(np.std(inc, ddof=1) / math.sqrt(len(inc))) if len(inc) > 1 else math.nan
    return float(np.mean(inc)), se, {"base_loss": ev.base_loss, "rho": s.average_rho, "draws": s.average_draws}


def magnitude_aware_sharpness(ev: _Evaluator, weights: list[np.ndarray], s: MeasureSettings,
                              seed: int) -> tuple[float, dict]:
    """``1/alpha'``, ``alpha'`` the largest scale with
    ``E_u L(w + u) - L(w) <= target``, ``u ~ N(0, alpha^2 w^2 + epsilon^2)`` (Jiang et al. 2020).

    The same ``magnitude_draws`` standard-normal draws are used at every trial scale,
    so the Monte Carlo increase is a smooth function of ``alpha`` and the bisection
    (in ``log alpha``) is well defined.
    """
    rng = _generator(seed, "magnitude")
    draws = [_standard_normals(rng, [w.shape for w in weights]) for _ in range(s.magnitude_draws)]
    squares = [w * w for w in weights]

    def increase(alpha: float) -> float:
        total = 0.0
        for xi in draws:
            total += ev.mean_loss([np.sqrt(alpha * alpha * w2 + s.epsilon ** 2) * z for w2, z in zip(squares, xi)])
        return total / len(draws) - ev.base_loss

    lo, hi = 1e-8, 1.0
    note = None
    if increase(lo) > s.target:
        note = (f"the noise floor epsilon={s.epsilon:g} alone raises the loss by more than the target "
                f"{s.target:g}; alpha' is reported at the search's lower end {lo:g}")
        alpha = lo
    else:
        while increase(hi) <= s.target:
            lo, hi = hi, hi * 4.0
            if hi > 1e6:
                note = "the loss never rose by the target up to alpha = 1e6; alpha' is reported there"
                break
        if note is None:
            for _ in range(s.bisections):
                mid = math.sqrt(lo * hi)
                if increase(mid) <= s.target:
                    lo = mid
                else:
                    hi = mid
        alpha = lo if note is None else hi
    detail = {"alpha": alpha, "target": s.target, "epsilon": s.epsilon, "draws": s.magnitude_draws,
              "base_loss": ev.base_loss}
    if note:
        detail["note"] = note
    return 1.0 / alpha, detail


def norm_products(weights: list[np.ndarray]) -> dict[str, float]:
    """``sum_l log ||W_l||_2`` and ``sum_l log ||W_l||_F``, each weight as its
    ``(out, in * kernel)`` matrix (method §10.3)."""
    spectral = frobenius = 0.0
    with np.errstate(divide="ignore"):
        for w in weights:
            matrix = w.reshape(w.shape[0], -1)
            spectral += float(np.log(np.linalg.norm(matrix, 2)))
            frobenius += float(np.log(np.linalg.norm(matrix)))
    return {"log_spectral_norm_product": spectral, "log_frobenius_norm_product": frobenius}


# --------------------------------------------------------------------------- the bound


def kl_upper_inverse(q: float, c: float) -> float:
    """``sup {p in [q, 1] : kl(q || p) <= c}``, the binary-kl inverse (Langford & Caruana).

    Bisection to 1e-12; ``kl(q||p) = q ln(q/p) + (1-q) ln((1-q)/(1-p))``.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}.")
    if c <= 0:
        return q
    if q >= 1.0:
        return 1.0

    def kl(p: float) -> float:
        total = 0.0
        if q > 0:
            total += q * math.log(q / p)
        total += (1 - q) * math.log((1 - q) / (1 - p))
        return total

    lo, hi = q, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl(mid) > c:
            hi = mid
        else:
            lo = mid
        if hi - lo < 1e-12:
            break
    return hi


def hyperprior_grid(s: MeasureSettings) -> tuple[int, float]:
    """``(points per scale, ln points)`` of the grid ``{k Delta : |k Delta| <= range}``."""
    points = 2 * int(math.floor(s.grid_range / s.grid_step)) + 1
    return points, math.log(points)


def posterior_log_variances(layer: Any, log_lambda: float, s: MeasureSettings) -> np.ndarray:
    """Log variances ``ln v_ij`` of one layer's posterior for a given ``lambda`` (method §10.6).

    Normalized sharpness gives ``v*_ij = sigma_i sigma'_j`` at ``lambda = 1``; at
    ``lambda`` the optimum of the same second-order objective is ``v* / sqrt(lambda)``.
    Each row scale ``ln sigma_i - ln(lambda)/2`` and each column scale ``ln sigma'_j`` is
    rounded to the hyperprior grid (and clipped to its range: degenerate rows and
    columns, whose optimum is at 0 or infinity, land at its ends).

    Returns:
        ``(out, in/groups)`` log variances, shared by the kernel entries.
    """
    with np.errstate(divide="ignore"):
        log_rows = np.log(np.asarray(layer.row_sigma, dtype=np.float64)) - 0.5 * log_lambda
        log_cols = np.log(np.asarray(layer.col_sigma, dtype=np.float64))

    def on_grid(x: np.ndarray) -> np.ndarray:
        x = np.clip(np.nan_to_num(x, nan=0.0, posinf=s.grid_range, neginf=-s.grid_range), -s.grid_range, s.grid_range)
        k = np.clip(np.round(x / s.grid_step), -math.floor(s.grid_range / s.grid_step),
                    math.floor(s.grid_range / s.grid_step))
        return k * s.grid_step

    out, cols = int(layer.shape[0]), int(layer.shape[1])
    groups = max(int(np.asarray(layer.col_sigma).size) // cols, 1)
    col_index = (np.arange(out) // (out // groups))[:, None] * cols + np.arange(cols)[None, :]
    return on_grid(log_rows)[:, None] + on_grid(log_cols)[col_index]


def pac_bayes_bounds(ev: _Evaluator, weights: list[np.ndarray], layers: Sequence[Any], s: MeasureSettings,
                     seed: int) -> dict[str, tuple[float, dict]]:
    """The PAC-Bayes bound of method §10.6 for the 0-1 loss and the bounded surrogate.

    For every candidate ``lambda = 2^k`` (``k = 0..lambda_grid``), with ``m``
    predictions, ``N`` posterior draws and ``n_P`` hyperprior choices,

        bound(lambda) = kl^-1(E_N, ln(|Lambda| / delta') / N)
                        + (KL(Q_lambda || P_lambda) + ln(n_P |Lambda| / delta)) / lambda + lambda / (8 m),

    and the reported bound is the smallest over the candidates; it holds with
    probability at least ``1 - delta - delta'``. Candidates are tried in increasing
    order of their deterministic part, which is a lower bound of their total, and the
    search stops once it exceeds the best total found.
    """
    m = ev.predictions
    points, ln_points = hyperprior_grid(s)
    scales = sum(int(layer.shape[0]) + int(np.asarray(layer.col_sigma).size) for layer in layers)
    lambdas = [2.0 ** k for k in range(s.lambda_grid + 1)]
    ln_prior_choices = scales * ln_points
    confidence = math.log(len(lambdas) / s.bound_delta)
    mc_rate = math.log(len(lambdas) / s.bound_mc_delta) / s.bound_draws
    loss_cap = math.log(1.0 / s.probability_floor)
    squares = [w * w for w in weights]

    def kl_and_log_variances(lam: float) -> tuple[float, list[np.ndarray]]:
        log_vs = [posterior_log_variances(layer, math.log(lam), s) for layer in layers]
        kl = 0.0
        for w2, log_v in zip(squares, log_vs):
            per_pair = w2.reshape(w2.shape[0], w2.shape[1], -1).sum(axis=-1)
            kl += float(np.sum(per_pair * np.exp(-log_v))) / 2.0
        return kl, log_vs

    candidates = []
    for lam in lambdas:
        kl, _ = kl_and_log_variances(lam)
        deterministic = (kl + ln_prior_choices + confidence) / lam + lam / (8.0 * m)
        candidates.append((deterministic, lam, kl))
    candidates.sort()
    rng = _generator(seed, "bound")
    best: dict[str, tuple[float, dict]] = {}
    tried = 0
    for deterministic, lam, kl in candidates:
        if best and all(deterministic >= value for value, _ in best.values()):
            break
        tried += 1
        # Recomputed rather than kept from the first pass: holding every candidate's variances
        # would cost |Lambda| copies of the weights, and this is elementwise work.
        _, log_vs = kl_and_log_variances(lam)
        stds = [np.exp(0.5 * lv).reshape(lv.shape + (1,) * (w.ndim - 2)) for lv, w in zip(log_vs, weights)]
        errors, surrogate = [], []
        for _ in range(s.bound_draws):
            xi = _standard_normals(rng, [w.shape for w in weights])
            losses, correct = ev.evaluate([sd * z for sd, z in zip(stds, xi)])
            errors.append(1.0 - float(np.mean(correct)))
            surrogate.append(float(np.mean(np.minimum(losses, loss_cap))) / loss_cap)
        for name, draws in (("pac_bayes_bound", errors), ("pac_bayes_bound_surrogate", surrogate)):
            empirical = float(np.mean(draws))
            posterior = kl_upper_inverse(min(max(empirical, 0.0), 1.0), mc_rate)
            value = posterior + deterministic
            if name not in best or value < best[name][0]:
                best[name] = (value, {
                    "lambda": lam, "kl": kl, "posterior_loss_estimate": empirical,
                    "posterior_loss_upper": posterior,
                    "complexity": (kl + ln_prior_choices + confidence) / lam, "hoeffding": lam / (8.0 * m),
                    "ln_hyperprior_choices": ln_prior_choices, "hyperprior_scales": scales,
                    "grid_points": points, "lambdas": len(lambdas), "draws": s.bound_draws,
                    "predictions": m, "delta": s.bound_delta, "mc_delta": s.bound_mc_delta,
                    "loss_at_w": ev.base_error if name == "pac_bayes_bound" else None,
                    "loss_cap": None if name == "pac_bayes_bound" else loss_cap,
                    "vacuous": bool(value >= 1.0),
                })
    for name in best:
        best[name][1]["candidates_tried"] = tried
    return best


# --------------------------------------------------------------------------- the driver


def compute_measures(model: PerturbationModel, names: Sequence[str], settings: MeasureSettings, *, seed: int,
                     layers: Sequence[Any] | None = None, progress: bool = False,
                     metadata: dict[str, Any] | None = None) -> MeasuresReport:
    """Compute the measures ``names`` of ``model`` (method §10).

    Args:
        model: The backend's perturbation model.
        names: Measures to compute (validated, in report order).
        settings: Validated settings.
        seed: Seed of normflat's generators.
        layers: The :class:`~normflat.core.report.LayerResult` of every layer of
            ``model`` (same names, same order), from ``analyze``: the optimal
            variances the bound needs.
        progress: Show a progress bar over passes over the data.
        metadata: Framework and loss, recorded in the report.

    Raises:
        UnsupportedMeasureError: From the backend, for a measure the model does not admit.
        ValueError: If the bound is asked for without matching layers.
    """
    from tqdm.auto import tqdm

    weights = [np.asarray(w, dtype=np.float64) for w in model.weights()]
    if not weights:
        raise ValueError("The model has no recognised weight layer, so no measure can be computed.")
    passes = _expected_passes(names, settings)
    bar = tqdm(total=passes, desc="normflat measures", unit="pass", leave=False, disable=not progress)
    try:
        ev = _Evaluator(model, lambda: bar.update(1))
        bar.update(1)
        values: dict[str, float] = {}
        errors: dict[str, float] = {}
        details: dict[str, dict[str, Any]] = {}
        for name in names:
            bar.set_postfix_str(name, refresh=False)
            if name == "adaptive_sharpness":
                values[name], details[name] = worst_adaptive_sharpness(ev, weights, settings)
            elif name == "average_adaptive_sharpness":
                values[name], errors[name], details[name] = average_adaptive_sharpness(ev, weights, settings, seed)
            elif name == "magnitude_aware_sharpness":
                values[name], details[name] = magnitude_aware_sharpness(ev, weights, settings, seed)
            elif name == "fisher_rao_norm":
                derivatives = np.asarray(model.weight_derivatives(), dtype=np.float64)
                values[name] = float(math.sqrt(np.mean(derivatives * derivatives)))
                details[name] = {"predictions": int(derivatives.size)}
            elif name == "path_norm":
                squared = float(model.squared_output())
                values[name] = math.sqrt(max(squared, 0.0))
                details[name] = {"squared": squared}
            elif name in ("log_spectral_norm_product", "log_frobenius_norm_product"):
                if name not in values:  # one pass over the weights gives both products
                    products = norm_products(weights)
                    values.update({n: products[n] for n in products if n in names})
        bound_names = [n for n in names if n in BOUND_MEASURES]
        if bound_names:
            if layers is None or [layer.name for layer in layers] != list(model.names):
                raise ValueError(
                    "The PAC-Bayes bound needs the optimal variances of normalized sharpness for every layer of "
                    "this model: pass report=normflat.analyze(model, data) of the same model (or leave report "
                    "out and normflat computes it).")
            bounds = pac_bayes_bounds(ev, weights, layers, settings, seed)
            for name in bound_names:
                values[name], details[name] = bounds[name]
    finally:
        bar.close()
    meta = dict(metadata or {})
    meta.update({"predictions": ev.predictions, "layers": list(model.names), "seed": seed,
                 "passes": ev.passes, "loss_at_w": ev.base_loss, "error_at_w": ev.base_error})
    return MeasuresReport(values=values, standard_errors=errors, details=details, settings=asdict(settings),
                          metadata=meta)


def _expected_passes(names: Sequence[str], s: MeasureSettings) -> int:
    """Passes over the data, for the progress bar (the searches may take a few more or fewer)."""
    total = 1
    if "adaptive_sharpness" in names:
        total += s.steps + 1
    if "average_adaptive_sharpness" in names:
        total += s.average_draws
    if "magnitude_aware_sharpness" in names:
        total += s.magnitude_draws * (s.bisections + 4)
    if any(n in names for n in BOUND_MEASURES):
        total += 3 * s.bound_draws
    return total
