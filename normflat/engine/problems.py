"""The one place that builds every :class:`~normflat.core.problem.LayerProblem`.

A backend describes each analyzed weight with a :class:`LayerSpec` and hands
over its canonical weight, diagonal and group estimates; the engine builds the
problems (groups, canonical layout, details) and the report metadata, so that
the keys are the same in every framework (:data:`METADATA_KEYS`,
:data:`DETAIL_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from normflat.core.problem import LayerProblem
from normflat.engine.options import AnalysisOptions

__all__ = ["LayerSpec", "ParameterStatus", "build_problems", "build_metadata", "split_diagonals",
           "coverage", "METADATA_KEYS", "DETAIL_KEYS"]

#: Keys present in the metadata of every report of a model, in every framework.
#: ``loss_terms`` is what the mean loss averages over (samples, or counted tokens);
#: ``excluded`` maps each parameter that is not a weight matrix by definition to the
#: reason (method §3); ``coverage`` is the analyzed fraction of the weight-matrix
#: entries (:func:`coverage`). ``estimator`` is the one used: ``"auto"`` is recorded as
#: the estimator it resolved to. ``sequence_signals`` is whether token logits' signals spanned
#: whole sequences (method §6.3; ``None`` for ``(n, C)`` logits or an estimator without signals).
METADATA_KEYS = (
    "framework", "framework_version", "loss", "estimator", "samples", "top_classes", "seed", "temperature",
    "sequence_signals",
    "examples", "batches", "dtype", "device", "world_size", "unsupported", "chunk_size",
    "memory_budget", "backend", "loss_terms", "excluded", "coverage",
)
#: Keys present in every layer's ``details``: the framework's parameter name, the
#: computational path (``"fast"``/``"generic"`` GGN, ``"hvp"``), and ``groups``.
DETAIL_KEYS = ("param", "path", "groups")


#: ``details["unused"]`` of a weight that no forward of the analysis used (its curvature is zero):
#: every backend's words.
UNUSED_NOTE = ("no module using it ran and the logits do not depend on it: its curvature is zero (it took "
               "no path)")


@dataclass
class LayerSpec:
    """One analyzed weight, as a backend reports it.

    Attributes:
        name: Layer name in the framework (``features.0``, ``dense_1``, ``layers/0``).
        kind: Short type label (``"dense"``, ``"conv2d"``, ``"depthwise_conv2d"``, ...).
        param: The framework's name of the weight (``features.0.weight``, a variable path).
        groups: Groups of a grouped convolution (canonical ``(out, in/groups, *k)``).
        path: ``"fast"`` or ``"generic"`` (GGN estimators) or ``"hvp"``.
        reason: Why the generic path was used, if it was.
        shared_with: Other names of a weight used by several layers (reported once).
        extra: Backend-specific details copied into the layer's details.
        blocks: For a parameter that packs several linear maps along its canonical
            rows (query/key/value projections, recurrent gates), ``(suffix, start,
            stop)`` per map: each becomes its own problem ``f"{name}.{suffix}"`` with
            canonical rows ``start:stop`` (method §3). ``None``: one problem.
    """

    name: str
    kind: str
    param: str
    groups: int = 1
    path: str = "fast"
    reason: str | None = None
    shared_with: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    blocks: list[tuple[str, int, int]] | None = None

    def problem_names(self) -> list[str]:
        """The report names of this weight's problems (one, or one per block)."""
        if not self.blocks:
            return [self.name]
        return [f"{self.name}.{suffix}" for suffix, _, _ in self.blocks]

    def details(self) -> dict[str, Any]:
        """The layer's report details (always :data:`DETAIL_KEYS`, then optional keys)."""
        d: dict[str, Any] = {"param": self.param, "path": self.path, "groups": self.groups}
        if self.path == "generic" and self.reason:
            d["generic_reason"] = self.reason
        if self.shared_with:
            d["shared_with"] = list(self.shared_with)
        d.update(self.extra)
        return d


def build_problems(specs: list[LayerSpec], weights: list[Any], diags: list[Any],
                   samples: list[Any]) -> list[LayerProblem]:
    """``LayerProblem`` per layer from canonical weights, diagonals and group estimates.

    Args:
        specs: The layers, in model order.
        weights: Canonical ``(out, in/groups, *kernel)`` weights.
        diags: Canonical diagonals, same shapes.
        samples: ``(K, *shape)`` canonical group estimates, or ``None`` per layer.
    """
    problems = []
    # The group estimates come from estimators.finalize, which forms each diagonal as their
    # mean and checks it finite (then so is every group): the O(K · size) checks of
    # LayerProblem are skipped (on resnet18 they took longer than the Hessian diagonal).
    for spec, w, d, s in zip(specs, weights, diags, samples):
        if not spec.blocks:
            problems.append(LayerProblem(spec.name, w, d, kind=spec.kind, hessian_diag_samples=s,
                                         details=spec.details(), groups=spec.groups, check_samples=False))
            continue
        for (suffix, start, stop), name in zip(spec.blocks, spec.problem_names()):
            details = {**spec.details(), "block": suffix, "rows": [int(start), int(stop)]}
            problems.append(LayerProblem(name, w[start:stop], d[start:stop], kind=spec.kind,
                                         hessian_diag_samples=None if s is None else s[:, start:stop],
                                         details=details, groups=spec.groups, check_samples=False))
    return problems


def split_diagonals(specs: list[LayerSpec], diags: list[Any]) -> dict[str, Any]:
    """``{problem name: canonical diagonal}``, packed weights split into their blocks."""
    out: dict[str, Any] = {}
    for spec, d in zip(specs, diags):
        if not spec.blocks:
            out[spec.name] = d
            continue
        for (_, start, stop), name in zip(spec.blocks, spec.problem_names()):
            out[name] = d[start:stop]
    return out


@dataclass(frozen=True)
class ParameterStatus:
    """What became of one parameter of the model (for ``excluded`` and ``coverage``).

    Attributes:
        name: The framework's parameter name.
        shape: Its shape.
        status: ``"analyzed"`` (a weight matrix in the measures), ``"excluded"`` (not a
            weight matrix by definition: biases, normalization parameters, vectors,
            tokens and tables added to activations, method §3) or ``"skipped"``
            (a weight normflat could not analyze; the user can register its layer).
        reason: Why it was excluded or skipped.
    """

    name: str
    shape: tuple[int, ...]
    status: str
    reason: str | None = None


def _matrix_entries(shape: tuple[int, ...]) -> int:
    """Entries of a parameter with at least two axes longer than 1 (else 0)."""
    if sum(1 for d in shape if int(d) > 1) < 2:
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n


def coverage(parameters: list[ParameterStatus]) -> float | None:
    """Analyzed fraction of the entries of the model's weight matrices.

    Counts the parameters with at least two axes longer than 1 that are not
    excluded by definition; ``None`` when there is none.
    """
    total = analyzed = 0
    for p in parameters:
        if p.status == "excluded":
            continue
        n = _matrix_entries(p.shape)
        total += n
        if p.status == "analyzed":
            analyzed += n
    return analyzed / total if total else None


def build_metadata(framework: str, framework_version: str, options: AnalysisOptions, *, examples: int,
                   batches: int, dtype: str, device: str, unsupported: list[str], world_size: int = 1,
                   chunk_size: int | None = None, memory_budget: int | None = None,
                   backend: dict[str, Any] | None = None, loss_terms: int | None = None,
                   parameters: list[ParameterStatus] | None = None, token_logits: bool = False) -> dict[str, Any]:
    """Report metadata with :data:`METADATA_KEYS`, the same in every framework.

    Args:
        loss_terms: Terms the mean loss averages (default: ``examples``).
        token_logits: Whether the model returned token logits ``(n, T, C)`` (for
            ``sequence_signals``).
        parameters: The session's parameter inventory, for ``excluded`` and
            ``coverage`` (``None``: not reported by the backend, both empty).
    """
    params = list(parameters or [])
    return {
        "framework": framework,
        "framework_version": framework_version,
        "loss": options.loss_name,
        "estimator": options.estimator,
        "samples": options.samples,
        "top_classes": options.top_classes,
        "seed": options.seed if options.stochastic else None,
        "temperature": options.temperature if options.loss == "nsce" else None,
        "sequence_signals": (options.per_sequence if token_logits and options.estimator in ("ggn", "ggn-mc", "ggn-topk")
                             else None),
        "examples": int(examples),
        "batches": int(batches),
        "dtype": str(dtype),
        "device": str(device),
        "world_size": int(world_size),
        "unsupported": list(unsupported),
        "chunk_size": chunk_size,
        "memory_budget": memory_budget,
        "backend": dict(backend or {}),
        "loss_terms": int(examples if loss_terms is None else loss_terms),
        "excluded": {p.name: p.reason or "not a weight matrix" for p in params if p.status == "excluded"},
        "coverage": coverage(params) if params else None,
    }
