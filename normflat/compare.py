"""Compare checkpoints: the measures, train/test accuracy and gap of each, and how each measure ranks the gap.

:func:`compare_checkpoints` is the random-label study (``normflat study``)
applied to the user's own model family: it analyzes every checkpoint on its
training data, measures its train and test accuracy and generalization gap
(train accuracy minus test accuracy), and with three or more checkpoints gives
Kendall's tau-b of each measure against the gap with its 95 % bootstrap interval
(the study's own :func:`normflat.study.stats.kendall_tau_ci`). The granulated
Kendall coefficient Psi of ``normflat study`` is not computed: it needs the
hyperparameter grid of a study, and checkpoints carry no hyperparameters. The checkpoints are read by
:func:`normflat.checkpoints.load_model`, the data by
:func:`normflat.checkpoints.load_data`.

Example:
    >>> from normflat.compare import compare_checkpoints
    >>> result = compare_checkpoints("ckpts/*.pt", factory="mymodels:make_net", train="train.npz", test="test.npz")
    >>> print(result.table())
    >>> result.to_csv("compare.csv"); result.to_json("compare.json"); result.figure("compare.png")
    >>> result.write("results/")     # all of them, replacing a previous run's files as a whole

The command line ``normflat compare`` (in :mod:`normflat.cli`) is a thin layer over
:func:`compare_checkpoints` and :meth:`CompareResult.write`.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from normflat.checkpoints import (
    CHECKPOINT_SUFFIXES,
    CheckpointError,
    accuracy,
    analysis_data,
    check_fits,
    load_data,
    load_model,
)
from normflat.core.constants import MEASURE_LABELS, MEASURES

__all__ = ["CompareResult", "compare_checkpoints", "expand_checkpoints", "COMPARE_FILES", "CHECKPOINT_SUFFIXES"]

SCHEMA = "normflat.compare/1"
#: The files :meth:`CompareResult.write` puts into its folder (replaced as a whole by the next run).
COMPARE_FILES = ("compare.csv", "compare.json", "compare.png", "reports/*.json")


def _finite_or_none(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class CompareResult:
    """The comparison of several checkpoints.

    Attributes:
        rows: One dict per checkpoint: ``checkpoint``, ``train_accuracy``,
            ``test_accuracy``, ``gap``, the four measures, ``examples`` (analyzed)
            and ``seconds``.
        correlations: ``{measure: {"tau": Kendall's tau-b against the gap, or None,
            "tau_ci": [lo, hi]}}``, the interval the 95 % percentile bootstrap over
            the checkpoints (2000 resamples, seed 0; see
            :func:`normflat.study.stats.kendall_tau_ci`); ``None`` with fewer than
            3 checkpoints or a constant column.
        reports: The full :class:`~normflat.Report` of each checkpoint, by name.
        settings: The analysis options and the data specifications.
    """

    rows: list[dict[str, Any]]
    correlations: dict[str, dict[str, Any]]
    reports: dict[str, Any] = field(default_factory=dict, repr=False)
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        """A text table: one line per checkpoint, then Kendall's tau of each measure
        with its 95 % bootstrap interval."""
        name_w = max([10] + [len(r["checkpoint"]) for r in self.rows])
        short = {"normalized_sharpness": "NS", "matrix_normalized_sharpness": "matrix NS",
                 "hessian_trace": "trace", "elementwise_bound": "elem. bound"}
        head = f"{'checkpoint':<{name_w}}  {'train acc':>9}  {'test acc':>8}  {'gap':>7}  " + "  ".join(
            f"{short[m]:>11}" for m in MEASURES)
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['checkpoint']:<{name_w}}  {_num(r['train_accuracy'], 9, 'f')}  "
                         f"{_num(r['test_accuracy'], 8, 'f')}  {_num(r['gap'], 7, 'f')}  "
                         + "  ".join(_num(r[m], 11, 'g') for m in MEASURES))
        lines.append("")
        if len(self.rows) < 3:
            lines.append("Kendall's tau against the gap needs at least 3 checkpoints.")
        else:
            lines.append(f"Kendall's tau (tau-b) of each measure against the generalization gap over the "
                         f"{len(self.rows)} checkpoints [95% bootstrap interval]:")
            for m in MEASURES:
                tau = self.correlations[m]["tau"]
                lo, hi = self.correlations[m].get("tau_ci") or (None, None)
                text = "n/a" if tau is None else f"{tau:+.3f}"
                if tau is not None and lo is not None and hi is not None:
                    text += f" [{lo:+.2f}, {hi:+.2f}]"
                lines.append(f"  {MEASURE_LABELS[m]:<28} {text}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (strict JSON: non-finite numbers are ``null``)."""
        return {
            "schema": SCHEMA,
            "rows": [{k: _finite_or_none(v) for k, v in r.items()} for r in self.rows],
            "correlations": {m: {k: [_finite_or_none(x) for x in v] if isinstance(v, (list, tuple))
                                 else _finite_or_none(v) for k, v in c.items()}
                             for m, c in self.correlations.items()},
            "settings": self.settings,
        }

    def to_json(self, path: str | os.PathLike, *, reports_dir: str | os.PathLike | None = None) -> str:
        """Write :meth:`to_dict` as JSON; with ``reports_dir`` also each checkpoint's full
        report as ``<reports_dir>/<checkpoint>.json``. Returns the path."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False))
        if reports_dir is not None:
            folder = Path(reports_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for name, report in self.reports.items():
                report.to_json(str(folder / (_safe_name(name) + ".json")))
        return str(path)

    def to_csv(self, path: str | os.PathLike) -> str:
        """One row per checkpoint, columns as in :attr:`rows`. Returns the path."""
        columns = ["checkpoint", "train_accuracy", "test_accuracy", "gap", *MEASURES, "examples", "seconds"]
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        return str(path)

    def plot(self, *, measures: Sequence[str] = MEASURES, figure: Any = None) -> Any:
        """The generalization gap against each measure, one point per checkpoint
        (labelled), Kendall's tau in each title, like ``normflat study``'s figure.

        Returns:
            A standalone matplotlib Figure.
        """
        from normflat.plotting import new_figure, require_matplotlib

        require_matplotlib()
        import numpy as np
        from matplotlib import ticker

        fig = figure or new_figure(figsize=(3.6 * len(measures), 3.6), layout="constrained")
        axes = fig.subplots(1, len(measures), squeeze=False)[0]
        gap = np.array([r["gap"] for r in self.rows], dtype=float)
        for ax, m in zip(axes, measures):
            vals = np.array([r[m] for r in self.rows], dtype=float)
            ax.scatter(vals, gap, s=30, c=np.arange(len(vals)), cmap="viridis", edgecolors="k", linewidths=0.4)
            for v, g, r in zip(vals, gap, self.rows):
                if math.isfinite(v) and math.isfinite(g):
                    ax.annotate(r["checkpoint"], (v, g), fontsize=6, xytext=(3, 3), textcoords="offset points")
            finite = vals[np.isfinite(vals)]
            if finite.size and np.all(finite > 0):
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            tau = self.correlations[m]["tau"]
            ax.set_title(f"{MEASURE_LABELS[m]}\nKendall τ = {'n/a' if tau is None else f'{tau:.3f}'}", fontsize=10)
            ax.set_xlabel(MEASURE_LABELS[m], fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("generalization gap\n(train acc. − test acc.)")
        fig.suptitle(f"{len(self.rows)} checkpoints (estimator {self.settings.get('estimator')}, "
                     f"loss {self.settings.get('loss')})")
        return fig

    def figure(self, path: str | os.PathLike, **kwargs: Any) -> str:
        """Draw :meth:`plot` into ``path`` (PNG, SVG, PDF); returns the path."""
        self.plot(**kwargs).savefig(path, dpi=110)
        return str(path)

    def write(self, out: str | os.PathLike, *, figure: bool = True) -> dict[str, str]:
        """Write ``compare.csv``, ``compare.json``, ``reports/<checkpoint>.json`` and
        (with ``figure`` and matplotlib installed) ``compare.png`` into the folder ``out``.

        The files are staged and replace the previous run's files there as a whole
        (see :mod:`normflat.study.outputs`): results of two runs never mix, and
        files normflat did not write are left alone.

        Returns:
            ``{"csv", "json", "reports"[, "figure"]}``: the paths written.

        Raises:
            normflat.study.outputs.OutputFolderError: If ``out`` is a file.
        """
        from normflat.study.outputs import replace_outputs

        out = Path(out)
        files = {"csv": str(out / "compare.csv"), "json": str(out / "compare.json"), "reports": str(out / "reports")}
        with replace_outputs(out, legacy=COMPARE_FILES) as stage:
            self.to_csv(stage / "compare.csv")
            self.to_json(stage / "compare.json", reports_dir=stage / "reports")
            if figure:
                try:
                    self.figure(stage / "compare.png")
                    files["figure"] = str(out / "compare.png")
                except ImportError:
                    pass  # matplotlib is optional
        return files


def _num(v: Any, width: int, kind: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return f"{'n/a' if v is None else str(v):>{width}}"
    return f"{v:>{width}.4f}" if kind == "f" else f"{v:>{width}.4g}"


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def expand_checkpoints(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The checkpoints named by ``paths``: files, Hugging Face directories, glob
    patterns, or a folder (its checkpoint files and HF subdirectories, sorted).

    Raises:
        CheckpointError: If nothing matches or a path does not exist.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        text = str(item)
        p = Path(text)
        if any(c in text for c in "*?[") and not p.exists():
            matches = sorted(glob.glob(text))
            if not matches:
                raise CheckpointError(f"No checkpoint matches the pattern {text!r}; check the path (quote it so "
                                      "the shell does not expand it first, or let the shell expand it).")
            out.extend(matches)
        elif p.is_dir() and not (p / "config.json").is_file():
            found = sorted(str(c) for c in p.iterdir()
                           if (c.is_file() and c.suffix.lower() in CHECKPOINT_SUFFIXES)
                           or (c.is_dir() and (c / "config.json").is_file()))
            if not found:
                raise CheckpointError(f"The folder {text} holds no checkpoint ({', '.join(CHECKPOINT_SUFFIXES)} files "
                                      "or Hugging Face directories).")
            out.extend(found)
        elif p.exists():
            out.append(text)
        else:
            raise CheckpointError(f"The checkpoint {text} does not exist; check the path.")
    if not out:
        raise CheckpointError("No checkpoint given; pass files, folders or glob patterns.")
    return list(dict.fromkeys(out))


def _names(paths: Sequence[str]) -> list[str]:
    """Short unique display names: file names, or the paths where names repeat."""
    names = [Path(p).name or p for p in paths]
    if len(set(names)) == len(names):
        return names
    return list(paths)


def _data(spec: Any, what: str) -> Any:
    if spec is None:
        raise CheckpointError(f"compare needs {what} data (--{what} FILE.npz): the gap is train accuracy minus "
                              "test accuracy.")
    return load_data(spec) if isinstance(spec, (str, os.PathLike)) else spec


def compare_checkpoints(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                        factory: str | Callable[[], Any] | None = None, train: Any = None, test: Any = None,
                        estimator: str = "ggn", framework: str | None = None, trust_pickle: bool = False,
                        batch_size: int = 256, echo: Callable[[str], Any] | None = None,
                        **analyze_options: Any) -> CompareResult:
    """Analyze each checkpoint on ``train``, measure train/test accuracy and the gap,
    and rank-correlate each measure with the gap.

    Args:
        paths: Checkpoint files, folders or glob patterns (see :func:`expand_checkpoints`).
        factory: ``"module:function"`` building the architecture (weight-only checkpoints).
        train: Training data: a path / ``"module:function"`` for
            :func:`~normflat.checkpoints.load_data`, or an ``(x, y)`` pair / loader.
            The measures are computed on it (with the labels the models were trained on).
        test: Test data, likewise, for the test accuracy.
        estimator: Hessian-diagonal estimator (default ``"ggn"``).
        framework: Passed to :func:`~normflat.checkpoints.load_model`.
        trust_pickle: Passed to :func:`~normflat.checkpoints.load_model`.
        batch_size: Batch size of the analysis and of the accuracy passes.
        echo: Called with one progress line per checkpoint (e.g. ``print``).
        **analyze_options: Other :func:`normflat.analyze` options (``loss``,
            ``samples``, ``seed``, ``max_batches``, ``on_unsupported``, ...).

    Raises:
        CheckpointError: For a missing checkpoint or data, or one that cannot be loaded.
    """
    import normflat
    from normflat.study.stats import kendall_tau_ci

    files = expand_checkpoints(paths)
    train_data, test_data = _data(train, "train"), _data(test, "test")
    options = {"progress": False, **analyze_options, "estimator": estimator}
    rows: list[dict[str, Any]] = []
    reports: dict[str, Any] = {}
    for path, name in zip(files, _names(files)):
        start = time.perf_counter()
        model = load_model(path, factory=factory, framework=framework, trust_pickle=trust_pickle)
        check_fits(model, train_data, f"the train data {train if isinstance(train, (str, os.PathLike)) else ''}".strip())
        check_fits(model, test_data, f"the test data {test if isinstance(test, (str, os.PathLike)) else ''}".strip())
        try:
            report = normflat.analyze(model, analysis_data(model, train_data, batch_size), **options)
            train_acc = accuracy(model, train_data, batch_size=batch_size)
            test_acc = accuracy(model, test_data, batch_size=batch_size)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{path}: {' '.join(str(err).split())}") from err
        row = {"checkpoint": name, "train_accuracy": train_acc, "test_accuracy": test_acc,
               "gap": train_acc - test_acc, **{m: float(getattr(report, m)) for m in MEASURES},
               "examples": report.metadata.get("examples"), "seconds": round(time.perf_counter() - start, 3)}
        rows.append(row)
        reports[name] = report
        if echo is not None:
            echo(f"{name}: train acc {train_acc:.4f}, test acc {test_acc:.4f}, gap {row['gap']:+.4f}, "
                 f"NS {row['normalized_sharpness']:.4g}")
    correlations: dict[str, dict[str, Any]] = {}
    for m in MEASURES:
        tau, ci = None, [None, None]
        if len(rows) >= 3:
            value, lo, hi = kendall_tau_ci([r[m] for r in rows], [r["gap"] for r in rows],
                                           level=0.95, resamples=2000, seed=0)
            tau = None if math.isnan(value) else value
            ci = [None if math.isnan(v) else v for v in (lo, hi)]
        correlations[m] = {"tau": tau, "tau_ci": ci}
    settings = {"estimator": estimator, "loss": options.get("loss", "nsce"),
                **{k: v for k, v in options.items() if k not in ("progress", "estimator") and _jsonable(v)},
                "factory": factory if isinstance(factory, str) or factory is None else getattr(factory, "__name__", "?"),
                "train": str(train) if isinstance(train, (str, os.PathLike)) else type(train).__name__,
                "test": str(test) if isinstance(test, (str, os.PathLike)) else type(test).__name__,
                "checkpoints": files}
    return CompareResult(rows=rows, correlations=correlations, reports=reports, settings=settings)


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))
