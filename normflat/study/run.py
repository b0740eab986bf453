"""The random-label study: train, analyze, rescale, correlate, write CSV/JSON/figures.

For every combination of label-randomization ratio, seed and training
hyperparameters a model is trained to fit its (partially random) training
labels, the four measures of method §4 are computed on the training data (the
labels it was trained on), and, in the *reparametrization arm*, recomputed after
a random function-preserving rescaling of the same model. Each measure is then
correlated with the generalization gap (training accuracy minus test accuracy)
by Kendall's tau (with a bootstrap confidence interval), the granulated Kendall
coefficient Psi over the hyperparameter grid, and Pearson's r, before and after
rescaling: a measure of the function keeps its tau, a measure of the
parametrization loses it.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import platform
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from normflat.core.constants import MEASURE_LABELS, MEASURES
from normflat.engine.rivals import RIVAL_LABELS, RIVAL_MEASURES, MeasureSettings, json_ready, validate_measure_names
from normflat.study.datasets import StudyInputError
from normflat.study.frameworks import FRAMEWORKS, FUNCTION_RTOL
from normflat.study.outputs import check_output_folder, replace_outputs
from normflat.study.stats import granulated_kendall, kendall_tau_ci, pearson_r

__all__ = [
    "FRAMEWORKS",
    "HYPERPARAMETERS",
    "MEASURE_LABELS",
    "StudyConfig",
    "StudyResult",
    "run_study",
    "load_result",
    "correlations",
    "format_table",
    "markdown_table",
    "psi_axes",
    "torch_loader",
]

DEFAULT_RATIOS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

#: The hyperparameters every model row carries, the axes of the granulated Kendall
#: coefficient Psi (those that take two or more values in a study). The seed is a
#: replicate, not an axis: it is held fixed within each group of Psi. (Rows of
#: results written before the width axis have no "width": Psi then leaves it out.)
HYPERPARAMETERS = ("ratio", "lr", "batch_size", "weight_decay", "width")
REPLICATES = ("seed",)
#: Cheaper rival-measure settings of quick mode (seconds per model, still every code path).
QUICK_RIVAL_SETTINGS = {"steps": 8, "average_draws": 5, "magnitude_draws": 3, "bisections": 12, "bound_draws": 20}

#: Confidence level, resamples and seed of the bootstrap interval of Kendall's tau.
TAU_CI_LEVEL, TAU_CI_RESAMPLES, TAU_CI_SEED = 0.95, 2000, 0

#: What a study wrote into its folder before folders had a manifest: replaced as a
#: whole by the next run (see :mod:`normflat.study.outputs`).
STUDY_FILES = ("results.csv", "results.json", "gap_vs_measures.png", "layers.png", "reports/run*.json")


@dataclass
class StudyConfig:
    """Settings of a study (the CLI's ``normflat study`` options).

    Attributes:
        dataset: ``"digits"``, ``"fashion-mnist"`` or ``"mnist"``; or data of your
            own: ``"path/to/data.npz"`` (arrays ``x_train``, ``y_train``, ``x_test``,
            ``y_test``, optional ``num_classes``), ``"module:function"`` /
            ``"file.py:function"`` or a callable returning a
            :class:`~normflat.study.datasets.Dataset`, a dict or a 4-tuple of those
            arrays (:func:`~normflat.study.datasets.load_user_dataset`). User inputs
            reach the model as they are (no layout conversion).
        data_dir: Where the dataset's files are (not for digits), or the argument
            of a dataset function.
        arch: ``"mlp"``, ``"cnn"`` or ``"cnn-bn"`` (``None`` with ``model``).
        model: A model family of your own instead of ``arch``: ``"module:factory"``,
            ``"path/to/file.py:factory"`` or a callable, called as
            ``factory(input_shape=..., num_classes=..., width=..., seed=...)`` for
            every model and returning a fresh model of ``framework`` (a torch
            ``nn.Module``; a ``keras.Model``; for jax an equinox module mapping one
            example to logits, or a ``(module, state)`` pair of
            ``eqx.nn.make_with_state``).
        framework: Training framework: ``"torch"``, ``"keras"`` or ``"jax"`` (equinox + optax).
        ratios: Fractions of training labels replaced by random ones.
        seeds: Seeds (initialization, label noise, minibatch order, rescaling).
        epochs: Maximum training epochs per model.
        lrs: Learning rates (the hyperparameter grid is the product of
            ``lrs``, ``batch_sizes`` and ``weight_decays``).
        batch_sizes: Training minibatch sizes.
        weight_decays: Weight decays.
        optimizer: ``"adam"`` (AdamW) or ``"sgd"`` (momentum 0.9).
        target_accuracy: Stop training once this training accuracy is reached
            (with ``fixed_epochs``: only whether a model counts as fitted).
        fixed_epochs: Train every model for exactly ``epochs`` epochs, never stopping
            early: the setting of the paper's §6.2, where weight decay and the
            learning rate act on the weight norms long after the data are fitted.
        widths: Widths, one more axis of the grid (``None``: the architecture's
            default): the hidden width of the built-in architectures, passed as
            ``width`` to a ``model`` factory.
        train_size: Training examples to use (``None``: all).
        test_size: Test examples to use (``None``: all).
        analysis_size: Training examples whose mean loss Hessian is analyzed
            (``None``: all training examples).
        analysis_batch_size: Batch size of the analysis data loader.
        estimator: Hessian-diagonal estimator (method §6).
        loss: ``"nsce"`` or ``"ce"``.
        samples: Probes / draws of the stochastic estimators.
        reparam: Run the reparametrization arm.
        reparam_orders: Rescaling factors are drawn from ``[10^-r, 10^r]``.
        out: Output folder; a new run replaces the previous run's files there as a
            whole (:mod:`normflat.study.outputs`).
        progress: Show progress bars.
        threads: torch CPU threads (default 1: the models are tiny and more threads
            mostly contend; ``None`` keeps torch's default).
        device: ``"auto"`` (CUDA where the framework finds it), ``"cpu"`` or
            ``"cuda"`` (an error where there is none). torch moves models and data
            there; Keras and JAX run under their own device placement.
        precision: Training precision: ``"float32"`` or ``"mixed"`` (torch
            autocast: float16 with a GradScaler on CUDA, bfloat16 on the CPU; Keras'
            built-in architectures: the per-layer policy ``"mixed_bfloat16"``).
            Accuracies and the analysis never use it.
        analysis_dtype: dtype of the analyzed copy of each model and of its data:
            ``"float64"`` (rounding ~1e-16, so any change after rescaling is the
            measure's) or ``"float32"`` (half the memory and time, for large models).
        rivals: The rival measures of method §10 computed for every model (and
            its rescaling), names of :data:`~normflat.engine.rivals.RIVAL_MEASURES`;
            empty: none.
        rival_settings: Fields of :class:`~normflat.engine.rivals.MeasureSettings`
            to change (quick mode: :data:`QUICK_RIVAL_SETTINGS`).
        quick: Quick mode (tiny settings, for tests and smoke runs).
    """

    dataset: str | Callable[..., Any] = "digits"
    data_dir: str | None = None
    arch: str | None = "mlp"
    model: str | Callable[..., Any] | None = None
    framework: str = "torch"
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 400
    lrs: tuple[float, ...] = (1e-3,)
    batch_sizes: tuple[int, ...] = (64,)
    weight_decays: tuple[float, ...] = (0.0,)
    optimizer: str = "adam"
    target_accuracy: float = 1.0
    fixed_epochs: bool = False
    widths: tuple[int | None, ...] = (None,)
    train_size: int | None = None
    test_size: int | None = None
    analysis_size: int | None = None
    analysis_batch_size: int = 256
    estimator: str = "ggn"
    loss: str = "nsce"
    samples: int | None = None
    reparam: bool = True
    reparam_orders: float = 2.0
    out: str = "normflat-study"
    progress: bool = True
    threads: int | None = 1
    device: str = "auto"
    precision: str = "float32"
    analysis_dtype: str = "float64"
    rivals: tuple[str, ...] = RIVAL_MEASURES
    rival_settings: dict[str, Any] = field(default_factory=dict)
    quick: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and self.arch == "mlp":
            self.arch = None  # the default architecture gives way to the model factory

    def validate(self) -> None:
        """Check the settings, naming the fix.

        Raises:
            ValueError: For an invalid setting.
        """
        from normflat.engine.options import validate_options
        from normflat.study.datasets import DATASETS, is_user_dataset
        from normflat.study.frameworks import ANALYSIS_DTYPES, DEVICES, PRECISIONS
        from normflat.study.models import ARCHITECTURES

        if self.framework not in FRAMEWORKS:
            raise ValueError(
                f"The study trains models in {', '.join(FRAMEWORKS)}; --framework "
                f"{self.framework!r} is not supported yet. Use --framework "
                f"{' or '.join(FRAMEWORKS)}, or analyze your own models with normflat.analyze()."
            )
        if is_user_dataset(self.dataset):
            if isinstance(self.dataset, str) and self.dataset.endswith(".npz") and not Path(self.dataset).is_file():
                raise ValueError(f"The dataset file {self.dataset} does not exist; give an existing .npz file with "
                                 "x_train, y_train, x_test and y_test.")
        elif self.dataset not in DATASETS:
            raise ValueError(f"Unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}, or give "
                             "data of your own as FILE.npz or MODULE:FUNCTION.")
        if self.model is not None:
            if self.arch is not None:
                raise ValueError(f"Give either an architecture (--arch {self.arch}) or a model factory (--model), "
                                 "not both.")
        elif self.arch not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}, or give "
                             "a model factory with --model module:function.")
        if not self.widths or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
                                  for w in self.widths):
            raise ValueError(f"Widths must be positive integers or None (the architecture's default), got "
                             f"{list(self.widths)}.")
        if len(set(self.widths)) != len(self.widths):
            raise ValueError(f"Widths must not repeat, got {list(self.widths)}.")
        if self.device not in DEVICES:
            raise ValueError(f"Unknown device {self.device!r}; choose one of {', '.join(DEVICES)}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}.")
        if self.analysis_dtype not in ANALYSIS_DTYPES:
            raise ValueError(f"Unknown analysis dtype {self.analysis_dtype!r}; choose one of "
                             f"{', '.join(ANALYSIS_DTYPES)}.")
        if not self.ratios or any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise ValueError(f"Ratios must be a non-empty list of numbers in [0, 1], got {list(self.ratios)}.")
        if not self.seeds:
            raise ValueError("At least one seed is needed.")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}.")
        if any(lr <= 0 for lr in self.lrs) or not self.lrs:
            raise ValueError(f"Learning rates must be positive, got {list(self.lrs)}.")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            raise ValueError(f"Batch sizes must be positive, got {list(self.batch_sizes)}.")
        if any(w < 0 for w in self.weight_decays) or not self.weight_decays:
            raise ValueError(f"Weight decays must be >= 0, got {list(self.weight_decays)}.")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"Unknown optimizer {self.optimizer!r}; choose 'adam' or 'sgd'.")
        if self.reparam_orders <= 0:
            raise ValueError(f"reparam_orders must be > 0 decades, got {self.reparam_orders}.")
        validate_options(loss=self.loss, estimator=self.estimator, samples=self.samples)
        validate_measure_names(self.rivals)
        if self.rivals and self.loss not in ("nsce", "ce"):
            raise ValueError(f"The rival measures need the loss 'nsce' or 'ce', got {self.loss!r}.")
        self.measure_settings()
        check_output_folder(self.out)

    def measure_settings(self) -> MeasureSettings:
        """The validated settings of the rival measures (quick mode: cheaper defaults)."""
        base = {**(QUICK_RIVAL_SETTINGS if self.quick else {}), **self.rival_settings}
        return MeasureSettings.from_overrides(None, base)

    @property
    def models(self) -> int:
        """Number of models the study trains."""
        return (len(self.ratios) * len(self.seeds) * len(self.widths) * len(self.lrs) * len(self.batch_sizes)
                * len(self.weight_decays))

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values (a callable dataset or model as ``module:qualname``)."""
        from normflat.study.models import callable_label

        out = asdict(self)
        for key in ("dataset", "model"):
            if callable(out[key]):
                out[key] = callable_label(out[key])
        return out


@dataclass
class StudyResult:
    """Everything a study produced.

    Attributes:
        config: The settings (as a dict).
        rows: One dict per trained model (settings, accuracies, gap, measures,
            measures after rescaling, timings).
        correlations: ``{arm: {measure: {"tau", "tau_ci", "pearson", "psi",
            "psi_per_axis"}}}`` with arms ``"trained"`` and ``"rescaled"``; see
            :func:`correlations`.
        environment: Versions, machine and total wall time.
        files: Paths of the files written, by role.
        statistics: How the correlations were computed: the bootstrap settings of
            ``tau_ci`` and the axes and replicates of ``psi`` (empty in results
            written before these existed).
    """

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    correlations: dict[str, dict[str, dict[str, float | None]]]
    environment: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    statistics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite numbers become ``null``)."""
        return json_ready(asdict(self))

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialize to standard JSON; also write it to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StudyResult":
        """Inverse of :meth:`to_dict`."""
        return cls(
            config=data["config"], rows=data["rows"], correlations=data["correlations"],
            environment=data.get("environment", {}), files=data.get("files", {}),
            statistics=data.get("statistics", {}),
        )


def load_result(path: str | os.PathLike) -> StudyResult:
    """Read a ``results.json`` written by :func:`run_study`."""
    with open(path, encoding="utf-8") as fh:
        return StudyResult.from_dict(json.load(fh))


def _hyperparameters(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's hyperparameters and replicate keys (those every row carries)."""
    keys = [k for k in (*HYPERPARAMETERS, *REPLICATES) if rows and all(k in row for row in rows)]
    return [{k: row[k] for k in keys} for row in rows]


def psi_axes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The hyperparameters that take two or more values over ``rows``: the axes of Psi."""
    return [k for k in HYPERPARAMETERS if rows and all(k in row for row in rows)
            and len({row[k] for row in rows}) >= 2]


def statistics_settings(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What :attr:`StudyResult.statistics` records about :func:`correlations`."""
    return {
        "tau": "Kendall's tau-b over all models",
        "tau_ci": {"method": "percentile bootstrap over models", "level": TAU_CI_LEVEL,
                   "resamples": TAU_CI_RESAMPLES, "seed": TAU_CI_SEED},
        "psi": {"method": "granulated Kendall coefficient (Jiang et al. 2020, section 4.2)",
                "axes": psi_axes(rows), "replicates": [k for k in REPLICATES if rows and all(k in r for r in rows)]},
    }


def _none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def correlations(rows: Sequence[dict[str, Any]], *, reparam: bool) -> dict[str, dict[str, dict[str, Any]]]:
    """Kendall's tau with its bootstrap interval, Psi and Pearson's r of every measure
    against the gap, per arm.

    Returns:
        ``{arm: {measure: {...}}}`` with arms ``"trained"`` and (with ``reparam``)
        ``"rescaled"`` (the ``rescaled_*`` columns), and per measure:

        - ``tau``: Kendall's tau-b over all models;
        - ``tau_ci``: ``[lo, hi]``, its 95 % percentile-bootstrap interval
          (:func:`~normflat.study.stats.kendall_tau_ci`, 2000 resamples of the
          models, seed 0: the same resamples for every measure and arm);
        - ``pearson``: Pearson's r;
        - ``psi``: the granulated Kendall coefficient
          (:func:`~normflat.study.stats.granulated_kendall`) over the
          hyperparameters of :data:`HYPERPARAMETERS` that take two or more values,
          the seed held fixed as a replicate;
        - ``psi_per_axis``: ``{axis: tau_i}`` for those axes.

        Undefined values (e.g. a constant column, or no axis for Psi) are ``None``.
    """
    gap = [row["gap"] for row in rows]
    hps = _hyperparameters(rows)
    arms = {"trained": ""}
    if reparam:
        arms["rescaled"] = "rescaled_"
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, prefix in arms.items():
        out[arm] = {}
        for m in measure_names(rows):
            values = [row[prefix + m] for row in rows]
            tau, lo, hi = kendall_tau_ci(values, gap, level=TAU_CI_LEVEL, resamples=TAU_CI_RESAMPLES,
                                         seed=TAU_CI_SEED)
            psi = granulated_kendall(values, gap, hps, replicates=REPLICATES)
            out[arm][m] = {"tau": _none(tau), "tau_ci": [_none(lo), _none(hi)],
                           "pearson": _none(pearson_r(values, gap)),
                           "psi": psi["psi"], "psi_per_axis": psi["per_axis"]}
    return out


def _fmt(value: float | None, width: int = 8) -> str:
    return ("n/a" if value is None else f"{value:+.3f}").rjust(width)


def _tau_cell(entry: dict[str, Any], width: int) -> str:
    """``+0.875 [+0.61, +0.95]``: tau and its bootstrap interval (2 decimals: about
    the Monte Carlo error of 2000 resamples)."""
    tau, ci = entry.get("tau"), entry.get("tau_ci") or [None, None]
    text = "n/a" if tau is None else f"{tau:+.3f}"
    if tau is not None and ci[0] is not None and ci[1] is not None:
        text += f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
    return text.rjust(width)


def _axes_note(result: StudyResult) -> str:
    axes = result.statistics.get("psi", {}).get("axes")
    if axes is None:
        axes = psi_axes(result.rows)
    if not axes:
        return "psi: n/a, no hyperparameter takes two values (seeds are replicates, not an axis)"
    return (f"psi: granulated Kendall tau (Jiang et al. 2020) over the axes {', '.join(axes)} (seed held "
            "fixed: a replicate, not an axis); per axis in results.json")


#: Every measure's label in the tables: normalized sharpness and its siblings, then the rivals.
LABELS = {**MEASURE_LABELS, **RIVAL_LABELS}


def measure_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The measures of method §4 and the rival measures of method §10 that every row carries."""
    return [m for m in (*MEASURES, *RIVAL_MEASURES) if rows and all(m in row for row in rows)]


def _bound_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where the PAC-Bayes bounds are vacuous (>= 1), per arm."""
    notes = []
    for name, label in (("pac_bayes_bound", "0-1 loss"), ("pac_bayes_bound_surrogate", "surrogate")):
        values = [row.get(name) for row in rows]
        if not rows or any(v is None for v in values):
            continue
        vacuous = sum(v >= 1.0 for v in values)
        notes.append(f"PAC-Bayes bound ({label}): {min(values):.3f} to {max(values):.3f}, vacuous (>= 1) for "
                     f"{vacuous}/{len(values)} models")
    return notes


def _model_label(cfg: dict[str, Any]) -> str:
    """What was trained: the architecture, or the model factory (results before
    ``model`` existed have only ``arch``)."""
    return cfg.get("model") or cfg.get("arch") or "?"


def format_table(result: StudyResult) -> str:
    """The correlation table printed at the end of a study."""
    cfg, corr = result.config, result.correlations
    rescaled = "rescaled" in corr
    lines = [
        f"Correlation with the generalization gap ({len(result.rows)} models: {cfg['dataset']}, "
        f"{_model_label(cfg)}, {cfg['framework']}, estimator={cfg['estimator']}, loss={cfg['loss']})",
    ]
    head = f"{'measure':<36}{'tau [95% CI]':>23}{'r':>8}{'psi':>8}"
    if rescaled:
        head += f"{'tau rescaled [95% CI]':>25}{'r rescaled':>12}{'psi rescaled':>14}"
    lines += [head, "-" * len(head)]
    for m in [m for m in LABELS if m in corr["trained"]]:
        t = corr["trained"][m]
        line = f"{LABELS[m]:<36}{_tau_cell(t, 23)}{_fmt(t['pearson'])}{_fmt(t.get('psi'))}"
        if rescaled:
            r = corr["rescaled"][m]
            line += f"{_tau_cell(r, 25)}{_fmt(r['pearson'], 12)}{_fmt(r.get('psi'), 14)}"
        lines.append(line)
    gaps = [r["gap"] for r in result.rows]
    fitted = sum(bool(r["fitted"]) for r in result.rows)
    lines.append("")
    ci = result.statistics.get("tau_ci", {})
    lines.append(
        f"tau: Kendall's tau-b over all {len(result.rows)} models, {ci.get('level', TAU_CI_LEVEL):.0%} "
        f"percentile-bootstrap interval ({ci.get('resamples', TAU_CI_RESAMPLES)} resamples of the models)"
    )
    lines.append(_axes_note(result))
    lines.append(
        f"gap from {min(gaps):.3f} to {max(gaps):.3f}; {fitted}/{len(result.rows)} models reached "
        f"training accuracy {cfg['target_accuracy']:g}"
        + (f" (every model trained {cfg['epochs']} epochs)" if cfg.get("fixed_epochs") else "")
    )
    lines += _bound_notes(result.rows)
    if rescaled:
        errs = [r["rescale_function_error"] for r in result.rows]
        spread = [r["rescale_spread_decades"] for r in result.rows]
        lines.append(
            f"rescaling: factors over {min(spread):.1f}-{max(spread):.1f} decades per model, "
            f"logits unchanged to {max(errs):.1e} (relative)"
        )
    return "\n".join(lines)


def markdown_table(result: StudyResult) -> str:
    """The correlation table as Markdown (for reports and docs): Kendall's tau with
    its 95 % bootstrap interval, Pearson's r and Psi, per arm."""
    corr = result.correlations
    rescaled = "rescaled" in corr
    head = "| measure | Kendall τ [95 % CI] | Pearson r | Ψ |" + (
        " τ after rescaling [95 % CI] | r after rescaling | Ψ after rescaling |" if rescaled else "")
    sep = "|---|---:|---:|---:|" + ("---:|---:|---:|" if rescaled else "")

    def f(v):
        return "n/a" if v is None else f"{v:.3f}"

    def t(entry):
        ci = entry.get("tau_ci") or [None, None]
        text = f(entry["tau"])
        if entry["tau"] is not None and None not in ci:
            text += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
        return text

    lines = [head, sep]
    for m in [m for m in LABELS if m in corr["trained"]]:
        cells = [LABELS[m]]
        for arm in ("trained", "rescaled") if rescaled else ("trained",):
            e = corr[arm][m]
            cells += [t(e), f(e["pearson"]), f(e.get("psi"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def torch_loader(x: Any, y: Any, batch_size: int) -> Any:
    """An unshuffled torch DataLoader over tensors ``x``, ``y``."""
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _analyze(model: Any, data: Any, config: StudyConfig, backend_options: dict[str, Any]) -> Any:
    import normflat

    return normflat.analyze(
        model, data, estimator=config.estimator, loss=config.loss, samples=config.samples,
        progress=config.progress, **backend_options,
    )


def _rivals(model: Any, data: Any, config: StudyConfig, backend_options: dict[str, Any], report: Any,
            seed: int) -> Any:
    """The rival measures of one model (method §10), with the analysis's variances for the bound.

    The seed depends on the labels only, so a model and its rescaling see the same
    noise draws (common random numbers, method §10).
    """
    import normflat

    return normflat.measures(
        model, data, config.rivals, report=report, settings=config.measure_settings(), loss=config.loss,
        seed=seed, progress=config.progress, backend_options=backend_options,
    )


def _versions(fw: Any) -> dict[str, Any]:
    import normflat

    return {
        "normflat": normflat.__version__,
        fw.name: fw.version(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def run_study(config: StudyConfig, *, echo: Any = print) -> StudyResult:
    """Run a study and write its files into ``config.out``.

    The files are staged and replace the previous run's files in ``config.out``
    only once the study has finished, so results of two runs never mix and a
    failed run leaves the previous results intact (:mod:`normflat.study.outputs`).

    Args:
        config: The settings.
        echo: Called with progress messages (``print`` by default; ``None`` silences).

    Returns:
        The :class:`StudyResult` (also written to ``results.json``).

    Raises:
        ValueError: For an invalid setting (:meth:`StudyConfig.validate`).
        StudyInputError: For data, a model factory, a device or a precision that
            cannot be used, found before any training and before ``config.out`` is
            touched (except a factory returning the same model twice, found at the
            second model); the message names the fix.
    """
    from normflat.study.frameworks import adapter

    say = echo or (lambda *a, **k: None)
    config.validate()
    fw = adapter(config.framework, device=config.device, precision=config.precision)
    fw.set_threads(config.threads)
    t_start = time.perf_counter()
    out = Path(config.out)
    with fw.placement():
        # The data, the model factory and the rescaling arm are checked before the output
        # folder is touched: a wrong input leaves no trace in --out.
        inputs = _prepare(config, fw)
        with replace_outputs(out, legacy=STUDY_FILES) as stage:
            return _run_study(config, fw, inputs, out, stage, say, t_start)


@dataclass
class _StudyInputs:
    """What every model of a study shares: the data converted for the framework and the model builder."""

    data: Any
    x_train: Any
    x_test: Any
    y_test: Any
    x_check: Any
    build: Callable[[int | None, int], Any]


def _prepare(config: StudyConfig, fw: Any) -> _StudyInputs:
    """Load the data, make the model builder and try the rescaling arm on fresh models."""
    from normflat.study.datasets import load_dataset

    data = load_dataset(config.dataset, config.data_dir, train_size=config.train_size,
                        test_size=config.test_size, seed=0)
    # Only the built-in architectures take the built-in image layout (NHWC for Keras); a
    # model factory gets its inputs as they are.
    images = config.model is None
    x_train, x_test = fw.inputs(data.x_train, images=images), fw.inputs(data.x_test, images=images)
    x_check = fw.check_inputs(x_test[: min(len(data.y_test), 512)], config.analysis_dtype)
    build = _model_builder(config, fw, data, x_train[:2])
    if config.reparam or "path_norm" in config.rivals:
        _preflight(build, config, fw, x_check, x_train[:2], fw.labels(data.y_train[:2]))
    return _StudyInputs(data, x_train, x_test, fw.labels(data.y_test), x_check, build)


def _model_builder(config: StudyConfig, fw: Any, data: Any, probe: Any) -> Callable[[int | None, int], Any]:
    """``build(width, seed)``: a fresh model of the architecture or of the ``--model``
    factory (checked on ``probe``, a few training inputs).

    Raises:
        StudyInputError: If the factory cannot be imported, or for a built-in architecture
            on inputs that are not images ``(n, channels, height, width)``.
    """
    from normflat.study.models import resolve_model_factory

    if config.model is None:
        if len(data.input_shape) != 3:
            shape = ", ".join(map(str, data.input_shape))
            raise StudyInputError(f"--arch {config.arch} takes images of shape (n, channels, height, width); the "
                                  f"dataset {data.name} has inputs of shape (n, {shape}). Give a model of your own "
                                  "with --model module:function.")
        return lambda width, seed: fw.build(config.arch, data.input_shape, data.num_classes, width=width, seed=seed)
    factory = resolve_model_factory(config.model)
    last: list[Any] = []  # a weak reference to the previous model: never keeps it alive

    def build(width: int | None, seed: int) -> Any:
        model = fw.build_user(factory, data.input_shape, data.num_classes, width=width, seed=seed, probe=probe)
        if last and last[0]() is model:
            raise StudyInputError(f"The model factory {config.to_dict()['model']} returned the same object twice; it "
                                  "must build a new, freshly initialized model on every call.")
        try:
            last[:] = [weakref.ref(model)]
        except TypeError:
            last.clear()  # not weak-referenceable (JAX pytrees): immutable, so reusing one is harmless anyway
        return model

    return build


def _preflight(build: Callable[[int | None, int], Any], config: StudyConfig, fw: Any, x_check: Any,
               x_probe: Any, y_probe: Any) -> None:
    """Try the rescaling arm and the path norm on a freshly built model of each width,
    before any training, so a model family they do not admit fails in seconds.

    Raises:
        StudyInputError: If the rescaler cannot rescale the model or the rescaled model
            computes another function (the message says to pass ``--no-reparam``), or
            if the path norm is not defined for the model (to leave it out of ``--rivals``).
    """
    from normflat.study.reparametrize import FunctionChangedError

    for width in config.widths:
        model = fw.analysis_copy(build(width, config.seeds[0]), config.analysis_dtype)
        if config.reparam:
            _check_rescaling(model, width, config, fw, x_check)
        if "path_norm" in config.rivals:
            _check_path_norm(model, config, fw, x_probe, y_probe)


def _check_rescaling(model: Any, width: int | None, config: StudyConfig, fw: Any, x_check: Any) -> None:
    from normflat.study.reparametrize import FunctionChangedError

    try:
        rescaled, _ = fw.rescale(model, orders=config.reparam_orders, seed=0)
        fw.function_error(model, rescaled, x_check, rtol=FUNCTION_RTOL[config.analysis_dtype])
    except (TypeError, ValueError, FunctionChangedError) as err:
        what = config.arch if config.model is None else config.to_dict()["model"]
        size = "default width" if width is None else f"width {width}"
        raise StudyInputError(
            f"The reparametrization arm cannot run on the models of {what} ({size}), tried on a freshly built one "
            f"before any training: {' '.join(str(err).split())[:300]} Pass --no-reparam "
            "(StudyConfig(reparam=False)) to run the study without the rescaled arm."
        ) from err


def _check_path_norm(model: Any, config: StudyConfig, fw: Any, x: Any, y: Any) -> None:
    import normflat
    from normflat.engine.perturbation import UnsupportedMeasureError

    data, kwargs = fw.analysis_data(x, y, len(y), config.analysis_dtype)
    try:
        normflat.measures(model, data, ["path_norm"], progress=False, backend_options=kwargs)
    except UnsupportedMeasureError as err:
        others = ",".join(r for r in config.rivals if r != "path_norm") or "none"
        raise StudyInputError(f"{err} In the study: pass --rivals {others} (StudyConfig(rivals=...)) to leave "
                              "the path norm out.") from err


def _run_study(config: StudyConfig, fw: Any, inputs: _StudyInputs, out: Path, stage: Path, say: Any,
               t_start: float) -> StudyResult:
    from tqdm.auto import tqdm

    from normflat.study.training import corrupt_labels

    (stage / "reports").mkdir()
    data, x_train, x_test, y_test, x_check, build = (inputs.data, inputs.x_train, inputs.x_test, inputs.y_test,
                                                     inputs.x_check, inputs.build)
    cfg = config.to_dict()
    say(f"normflat study: {config.models} models ({data.name}: {len(data.y_train)} train / "
        f"{len(data.y_test)} test examples, {_model_label(cfg)}, {config.framework} on {fw.device_description()}); "
        f"output in {out}/")
    n_an = len(data.y_train) if config.analysis_size is None else min(config.analysis_size, len(data.y_train))
    dtype, rtol = config.analysis_dtype, FUNCTION_RTOL[config.analysis_dtype]

    grid = list(itertools.product(config.seeds, config.widths, config.ratios, config.lrs, config.batch_sizes,
                                  config.weight_decays))
    rows: list[dict[str, Any]] = []
    # The per-layer figure shows the cleanest model: lowest ratio, first seed, first grid point.
    showcase = next(i for i, g in enumerate(grid) if g[2] == min(config.ratios))
    layer_reports: dict[str, Any] = {}
    bar = tqdm(grid, desc="models", unit="model", disable=not config.progress)
    for run_id, (seed, width, ratio, lr, bs, wd) in enumerate(bar):
        bar.set_postfix(ratio=ratio, seed=seed, refresh=True)
        # Label noise and rescaling depend on (seed, ratio) only, so the hyperparameter
        # grid (widths included) compares models trained on identical labels.
        label_seed = 1_000_003 * seed + int(round(ratio * 1000))
        y_noisy = fw.labels(corrupt_labels(data.y_train, ratio, data.num_classes, label_seed))
        model = build(width, seed)
        trained = fw.train(
            model, x_train, y_noisy, epochs=config.epochs, lr=lr, batch_size=bs, weight_decay=wd,
            optimizer=config.optimizer, target_accuracy=math.inf if config.fixed_epochs else config.target_accuracy,
            seed=seed, progress=config.progress, desc=f"train r={ratio:g} s={seed}",
        )
        evaluated = fw.evaluation_model(model)  # float32 even where training was mixed-precision
        train_acc = fw.accuracy(evaluated, x_train, y_noisy)
        test_acc = fw.accuracy(evaluated, x_test, y_test)
        # Analyze in float64 by default: the Hessian diagonal and the function check are then
        # exact to ~1e-15, so any change after rescaling is the measure's, not rounding.
        model_an = fw.analysis_copy(model, dtype)
        an_data, an_kwargs = fw.analysis_data(x_train[:n_an], y_noisy[:n_an], config.analysis_batch_size, dtype)
        t0 = time.perf_counter()
        report = _analyze(model_an, an_data, config, an_kwargs)
        t_an = time.perf_counter() - t0
        rivals = None
        if config.rivals:
            t0 = time.perf_counter()
            rivals = _rivals(model_an, an_data, config, an_kwargs, report, label_seed)
            rivals.to_json(stage / "reports" / f"run{run_id:03d}_measures.json")
            t_rivals = time.perf_counter() - t0
        row: dict[str, Any] = {
            "run": run_id, "ratio": ratio, "seed": seed, "lr": lr, "batch_size": bs, "weight_decay": wd,
            "width": width,
            "epochs": trained.epochs, "fitted": train_acc >= config.target_accuracy if config.fixed_epochs else trained.fitted, "train_loss": trained.train_loss,
            "train_accuracy": train_acc, "test_accuracy": test_acc, "gap": train_acc - test_acc,
            **{m: getattr(report, m) for m in MEASURES},
            **(rivals.values if rivals is not None else {}),
            "train_seconds": trained.seconds, "analyze_seconds": t_an,
        }
        if rivals is not None:
            row["rivals_seconds"] = t_rivals
        report.to_json(stage / "reports" / f"run{run_id:03d}.json")
        if run_id == showcase:
            layer_reports["trained"] = report
        if config.reparam:
            rescaled, spread = fw.rescale(model_an, orders=config.reparam_orders, seed=label_seed + 7)
            err = fw.function_error(model_an, rescaled, x_check, rtol=rtol)
            report_r = _analyze(rescaled, an_data, config, an_kwargs)
            row.update({f"rescaled_{m}": getattr(report_r, m) for m in MEASURES})
            if config.rivals:
                rivals_r = _rivals(rescaled, an_data, config, an_kwargs, report_r, label_seed)
                rivals_r.to_json(stage / "reports" / f"run{run_id:03d}_rescaled_measures.json")
                row.update({f"rescaled_{m}": v for m, v in rivals_r.values.items()})
            row["rescale_function_error"] = err
            row["rescale_spread_decades"] = spread
            report_r.to_json(stage / "reports" / f"run{run_id:03d}_rescaled.json")
            if run_id == showcase:
                layer_reports["rescaled"] = report_r
        rows.append(row)
        del model, evaluated, model_an  # free a large model (and its GPU memory) before the next one
    bar.close()

    result = StudyResult(
        config=cfg, rows=rows, correlations=correlations(rows, reparam=config.reparam),
        environment={**_versions(fw), "device": fw.device_description(), "wall_seconds": None},
        statistics=statistics_settings(rows),
    )
    names = _write_outputs(result, stage, layer_reports, rows[showcase])
    result.environment["wall_seconds"] = time.perf_counter() - t_start
    result.files = {role: str(out / name) for role, name in names.items()}  # where they end up
    result.to_json(stage / "results.json")
    return result


def _write_outputs(result: StudyResult, stage: Path, layer_reports: dict[str, Any],
                   showcase: dict[str, Any]) -> dict[str, str]:
    """Write the CSV and the figures into ``stage``; returns their names by role."""
    files = {"csv": "results.csv", "json": "results.json", "reports": "reports"}
    columns = list(result.rows[0].keys())
    with open(stage / "results.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return files  # figures are optional: matplotlib is not a core dependency
    from normflat.plotting import save_layers_figure
    from normflat.study.figures import save_study_figure

    files["figure"] = "gap_vs_measures.png"
    save_study_figure(result, str(stage / files["figure"]))
    files["layers_figure"] = "layers.png"
    save_layers_figure(
        layer_reports, str(stage / files["layers_figure"]),
        title=f"run {showcase['run']} (ratio {showcase['ratio']:g}, seed {showcase['seed']})",
    )
    return files
