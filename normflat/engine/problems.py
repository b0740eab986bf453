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

__all__ = ["LayerSpec", "build_problems", "build_metadata", "METADATA_KEYS", "DETAIL_KEYS"]

#: Keys present in the metadata of every report of a model, in every framework.
METADATA_KEYS = (
    "framework", "framework_version", "loss", "estimator", "samples", "seed", "temperature",
    "examples", "batches", "dtype", "device", "world_size", "unsupported", "chunk_size",
    "memory_budget", "backend",
)
#: Keys present in every layer's ``details``: the framework's parameter name, the
#: computational path (``"fast"``/``"generic"`` GGN, ``"hvp"``), and ``groups``.
DETAIL_KEYS = ("param", "path", "groups")


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
    """

    name: str
    kind: str
    param: str
    groups: int = 1
    path: str = "fast"
    reason: str | None = None
    shared_with: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

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
    return [
        LayerProblem(spec.name, w, d, kind=spec.kind, hessian_diag_samples=s, details=spec.details(),
                     groups=spec.groups)
        for spec, w, d, s in zip(specs, weights, diags, samples)
    ]


def build_metadata(framework: str, framework_version: str, options: AnalysisOptions, *, examples: int,
                   batches: int, dtype: str, device: str, unsupported: list[str], world_size: int = 1,
                   chunk_size: int | None = None, memory_budget: int | None = None,
                   backend: dict[str, Any] | None = None) -> dict[str, Any]:
    """Report metadata with :data:`METADATA_KEYS`, the same in every framework."""
    return {
        "framework": framework,
        "framework_version": framework_version,
        "loss": options.loss_name,
        "estimator": options.estimator,
        "samples": options.samples,
        "seed": options.seed if options.stochastic else None,
        "temperature": options.temperature if options.loss == "nsce" else None,
        "examples": int(examples),
        "batches": int(batches),
        "dtype": str(dtype),
        "device": str(device),
        "world_size": int(world_size),
        "unsupported": list(unsupported),
        "chunk_size": chunk_size,
        "memory_budget": memory_budget,
        "backend": dict(backend or {}),
    }
