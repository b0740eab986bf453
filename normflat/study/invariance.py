"""The invariance demonstration behind ``normflat invariance``.

One trained model is rescaled without changing its function by random factors
spread over more and more decades; each measure is recomputed and divided by its
value on the original model. Normalized sharpness (and the element-wise bound)
stay at 1; the Hessian trace and the matrix-normalized sharpness move by orders
of magnitude.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

from normflat.core.constants import MEASURE_LABELS, MEASURES
from normflat.study.outputs import replace_outputs

__all__ = ["DEFAULT_ORDERS", "INVARIANCE_FILES", "invariance_rows", "format_invariance", "write_invariance"]

#: Decades ``r`` of the factor draws (factors in ``[10^-r, 10^r]``).
DEFAULT_ORDERS = (0.5, 1.0, 2.0, 3.0, 4.0)

#: The files ``normflat invariance`` writes (replaced as a whole by the next run).
INVARIANCE_FILES = ("invariance.csv", "invariance.json", "invariance.png")


def invariance_rows(
    model: Any,
    loader: Any,
    check_x: Any,
    *,
    orders: Sequence[float] = DEFAULT_ORDERS,
    seed: int = 0,
    analyze_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], Any]:
    """Measures of ``model`` and of random function-preserving rescalings of it.

    Args:
        model: A study-style torch ``nn.Sequential`` (float64 recommended).
        loader: Data passed to :func:`normflat.analyze`.
        check_x: Inputs on which the rescaled model's logits are compared.
        orders: Decades of each rescaling.
        seed: Seed of the factor draws.
        analyze_kwargs: Options of :func:`normflat.analyze` (estimator, loss, ...).

    Returns:
        ``(rows, report)``: one row per rescaling (the first, ``orders = 0``, is the
        original model) with every measure, its ratio to the original, the drawn
        spread and the logits error; and the original model's report.

    Raises:
        TypeError: If the model is not an ``nn.Sequential`` the rescaler understands.
    """
    import normflat
    from normflat.study.reparametrize import apply_rescaling, check_same_function, random_rescaling

    kwargs = dict(analyze_kwargs or {})
    if type(model).__name__ != "Sequential":
        raise TypeError(
            "normflat invariance rescales torch nn.Sequential models built from Linear, Conv2d, "
            f"BatchNorm, ReLU, MaxPool2d and Flatten; got {type(model).__name__}. Train one with "
            "`normflat invariance --dataset ... --arch ...` instead of --model."
        )
    base = normflat.analyze(model, loader, **kwargs)
    rows = [{"orders": 0.0, "spread_decades": 0.0, "function_error": 0.0,
             **{m: getattr(base, m) for m in MEASURES}, **{f"{m}_ratio": 1.0 for m in MEASURES}}]
    for i, r in enumerate(orders):
        rescaling = random_rescaling(model, orders=r, seed=seed + 1 + i)
        rescaled = apply_rescaling(model, rescaling)
        err = check_same_function(model, rescaled, check_x, rtol=1e-9)
        rep = normflat.analyze(rescaled, loader, **kwargs)
        row = {"orders": float(r), "spread_decades": rescaling.spread, "function_error": err}
        for m in MEASURES:
            row[m] = getattr(rep, m)
            row[f"{m}_ratio"] = getattr(rep, m) / getattr(base, m)
        rows.append(row)
    return rows, base


def format_invariance(rows: Sequence[dict[str, Any]]) -> str:
    """The table printed by ``normflat invariance``: each measure relative to the original."""
    head = f"{'r (decades)':>11}{'logits err':>12}" + "".join(f"{MEASURE_LABELS[m]:>30}" for m in MEASURES)
    lines = ["Measure of the rescaled model / measure of the original (same function):", head, "-" * len(head)]
    for row in rows:
        lines.append(f"{row['orders']:>11.1f}{row['function_error']:>12.1e}"
                     + "".join(f"{row[f'{m}_ratio']:>30.6g}" for m in MEASURES))
    lines.append("")
    for m in MEASURES:
        dev = max(abs(row[f"{m}_ratio"] - 1.0) for row in rows)
        lines.append(f"{MEASURE_LABELS[m]}: largest relative change {dev:.2e}")
    return "\n".join(lines)


def write_invariance(rows: Sequence[dict[str, Any]], out: str | Path, meta: dict[str, Any]) -> dict[str, str]:
    """Write ``invariance.csv``, ``invariance.json`` and (with matplotlib) ``invariance.png``.

    They replace the previous run's files in ``out`` as a whole
    (:mod:`normflat.study.outputs`): no figure of an earlier run stays beside new numbers.
    """
    out = Path(out)
    names = {"csv": "invariance.csv", "json": "invariance.json"}
    with replace_outputs(out, legacy=INVARIANCE_FILES) as stage:
        with open(stage / names["csv"], "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
            writer.writeheader()
            for row in rows:
                writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
        (stage / names["json"]).write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n",
                                           encoding="utf-8")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass  # figures are optional: matplotlib is not a core dependency
        else:
            from normflat.study.figures import save_invariance_figure

            names["figure"] = "invariance.png"
            save_invariance_figure(rows, str(stage / names["figure"]))
    return {role: str(out / name) for role, name in names.items()}
