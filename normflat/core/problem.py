"""The canonical per-layer problem every backend hands to the core."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from normflat.core._arrays import namespace_of

__all__ = ["LayerProblem"]


@dataclass(frozen=True, eq=False)
class LayerProblem:
    """One weight tensor and the diagonal of the loss Hessian with respect to it.

    Both arrays use the canonical layout ``(out, in, *kernel)``: rows are output
    units or channels, columns are input units or channels (per group for grouped
    convolutions), and any remaining axes are spatial kernel axes, which share one
    posterior variance per (row, column) pair (SPEC §3).

    Args:
        name: The layer's name in its framework (``features.0``, ``dense_1``,
            ``layers/0``); used in reports and error messages.
        weight: The weight tensor, any array-API array (numpy, torch, jax, ...).
        hessian_diag: The Hessian diagonal of the mean training loss with respect
            to ``weight``, same shape. Negative entries are allowed; curvature is
            clipped at zero after the kernel sum (SPEC §6).
        kind: A short label of the layer type (``"dense"``, ``"conv2d"``, ...).
        hessian_diag_samples: Optional ``(K, *weight.shape)`` array of ``K >= 2``
            independent, unbiased estimates of the diagonal whose mean is
            ``hessian_diag`` (for example group means of Hutchinson probes). When
            given, the report carries standard errors of every measure.
        details: Free-form information from the backend (which computational path
            produced the diagonal, sample counts); copied into the report.
        groups: Number of groups of a grouped convolution. The canonical weight is
            then ``(out, in/groups, *kernel)`` and output channels
            ``[g·out/groups, (g+1)·out/groups)`` see only input channels
            ``[g·in/groups, (g+1)·in/groups)``. Each input channel has its own
            column variance, so the layer's problem splits into ``groups``
            independent blocks (depthwise convolutions: ``groups = in``).

    Raises:
        TypeError: If an array is not a floating-point array.
        ValueError: If shapes differ, are not at least 2-D, or contain NaN/inf.
    """

    name: str
    weight: Any
    hessian_diag: Any
    kind: str = "dense"
    hessian_diag_samples: Any = None
    details: Mapping[str, Any] = field(default_factory=dict)
    groups: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"LayerProblem name must be a non-empty string, got {self.name!r}.")
        _check_array(self.name, "weight", self.weight)
        _check_array(self.name, "hessian_diag", self.hessian_diag)
        w_shape, h_shape = tuple(self.weight.shape), tuple(self.hessian_diag.shape)
        if len(w_shape) < 2:
            raise ValueError(
                f"Layer {self.name!r}: weight has shape {w_shape}, but the canonical layout "
                "(out, in, *kernel) needs at least 2 dimensions. Biases and normalization "
                "parameters do not enter the measures; reshape a vector weight to (out, 1) "
                "if it really is a weight matrix."
            )
        if w_shape != h_shape:
            raise ValueError(
                f"Layer {self.name!r}: weight shape {w_shape} and hessian_diag shape "
                f"{h_shape} differ; both must be in the canonical (out, in, *kernel) layout."
            )
        if any(d == 0 for d in w_shape):
            raise ValueError(f"Layer {self.name!r}: weight shape {w_shape} has an empty axis.")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"Layer {self.name!r}: groups must be a positive int, got {self.groups!r}.")
        if w_shape[0] % self.groups:
            raise ValueError(
                f"Layer {self.name!r}: {w_shape[0]} output channels cannot be split into "
                f"{self.groups} groups."
            )
        if self.hessian_diag_samples is not None:
            _check_array(self.name, "hessian_diag_samples", self.hessian_diag_samples)
            s_shape = tuple(self.hessian_diag_samples.shape)
            if len(s_shape) != len(w_shape) + 1 or s_shape[1:] != w_shape or s_shape[0] < 2:
                raise ValueError(
                    f"Layer {self.name!r}: hessian_diag_samples has shape {s_shape}; expected "
                    f"(K, {', '.join(map(str, w_shape))}) with K >= 2 independent estimates."
                )
        object.__setattr__(self, "details", dict(self.details))

    @property
    def in_features(self) -> int:
        """Number of input units/channels of the layer (all groups)."""
        return int(self.weight.shape[1]) * self.groups

    @property
    def shape(self) -> tuple[int, ...]:
        """The canonical shape ``(out, in, *kernel)``."""
        return tuple(int(d) for d in self.weight.shape)


def _check_array(layer: str, what: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"Layer {layer!r}: {what} must be an array (numpy, torch, jax or another "
            f"array-API library), got {type(x).__name__}."
        )
    try:
        xp = namespace_of(x)
    except TypeError as err:
        raise TypeError(
            f"Layer {layer!r}: {what} of type {type(x).__name__} is not an array-API "
            "array; convert it with numpy.asarray first."
        ) from err
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(
            f"Layer {layer!r}: {what} has dtype {x.dtype}; a real floating-point dtype is "
            "required (cast integer arrays with .astype(float))."
        )
    if x.ndim > 0 and not bool(xp.all(xp.isfinite(x))):
        raise ValueError(
            f"Layer {layer!r}: {what} contains NaN or infinite values; check the model's "
            "weights and the data, or the estimator's settings."
        )
