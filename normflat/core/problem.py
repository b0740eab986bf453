"""The canonical per-layer problem every backend hands to the core."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import array_api_compat
import numpy as np

from normflat.core._arrays import as_float64, namespace_of, to_float, to_numpy

__all__ = ["LayerProblem"]


@dataclass(frozen=True, eq=False)
class LayerProblem:
    """One weight tensor and the diagonal of the loss Hessian with respect to it.

    Both arrays use the canonical layout ``(out, in, *kernel)``: rows are output
    units or channels, columns are input units or channels (per group for grouped
    convolutions), and any remaining axes are spatial kernel axes, which share one
    posterior variance per (row, column) pair (method §3).

    Args:
        name: The layer's name in its framework (``features.0``, ``dense_1``,
            ``layers/0``); used in reports and error messages.
        weight: The weight tensor, any array-API array (numpy, torch, jax, ...).
        hessian_diag: The Hessian diagonal of the mean training loss with respect
            to ``weight``, same shape. Negative entries are allowed; curvature is
            clipped at zero after the kernel sum (method §6).
        kind: A short label of the layer type (``"dense"``, ``"conv2d"``, ...).
        hessian_diag_samples: Optional ``(K, *weight.shape)`` array of ``K >= 2``
            independent, unbiased estimates of the diagonal whose mean over ``K``
            is ``hessian_diag`` (for example group means of Hutchinson probes);
            the mean is checked to within ``1e-6 · max|hessian_diag|`` (plus the
            rounding of the samples' dtype). When given, the report carries
            standard errors of every measure (method §6). For a weight with kernel
            axes the samples may instead be their kernel sums, ``(K, out, in, 1, ...,
            1)``: the measures see the curvature only through ``Σ_k H_ijk`` (method §3),
            and the mean is then checked against the kernel sums of ``hessian_diag``.
        details: Free-form information from the backend (which computational path
            produced the diagonal, sample counts); copied into the report.
        groups: Number of groups of a grouped convolution. The canonical weight is
            then ``(out, in/groups, *kernel)`` and output channels
            ``[g·out/groups, (g+1)·out/groups)`` see only input channels
            ``[g·in/groups, (g+1)·in/groups)``. Each input channel has its own
            column variance, so the layer's problem splits into ``groups``
            independent blocks (depthwise convolutions: ``groups = in``).
        check_samples: Whether to check that ``hessian_diag_samples`` are finite and
            average to ``hessian_diag`` (two passes over ``K`` copies of the layer). A
            producer that forms ``hessian_diag`` as their mean and has checked it finite,
            as normflat's engine does, passes ``False``; the shape is always checked.

    Raises:
        TypeError: If an array is not a floating-point array.
        ValueError: If shapes differ, are not at least 2-D, contain NaN/inf, or the
            mean of ``hessian_diag_samples`` is not ``hessian_diag``.
    """

    name: str
    weight: Any
    hessian_diag: Any
    kind: str = "dense"
    hessian_diag_samples: Any = None
    details: Mapping[str, Any] = field(default_factory=dict)
    groups: int = 1
    check_samples: bool = field(default=True, repr=False, compare=False)

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
            if self.check_samples:
                _check_array(self.name, "hessian_diag_samples", self.hessian_diag_samples)
            s_shape = tuple(self.hessian_diag_samples.shape)
            summed = w_shape[:2] + (1,) * (len(w_shape) - 2)
            if len(s_shape) != len(w_shape) + 1 or s_shape[1:] not in (w_shape, summed) or s_shape[0] < 2:
                alternative = f" or their kernel sums (K, {', '.join(map(str, summed))})" if len(w_shape) > 2 else ""
                raise ValueError(
                    f"Layer {self.name!r}: hessian_diag_samples has shape {s_shape}; expected "
                    f"(K, {', '.join(map(str, w_shape))}){alternative} with K >= 2 independent estimates."
                )
            if self.check_samples:
                _check_samples_mean(self.name, self.hessian_diag, self.hessian_diag_samples)
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
    if x.ndim > 0 and not _all_finite(xp, x):
        raise ValueError(
            f"Layer {layer!r}: {what} contains NaN or infinite values; check the model's "
            "weights and the data, or the estimator's settings."
        )


def _all_finite(xp: Any, x: Any) -> bool:
    """Whether every entry is finite.

    First from the sum: a NaN or an infinity among the terms makes it non-finite (either
    propagates through the additions), so a finite sum settles it in one reduction (torch's
    ``isfinite(x).all()`` took 17 times as long on a convolution's 2.4M weights). A sum that is
    not finite (a non-finite entry, or finite entries whose sum overflows) takes the exact
    check, a slice of the leading axis at a time (the masks of a layer's ``K`` group samples at
    once would be ``K`` bytes per weight).
    """
    with np.errstate(over="ignore", invalid="ignore"):  # numpy's overflow in the sum: the exact check decides
        if bool(xp.all(xp.isfinite(xp.sum(x)))):
            return True
    n = int(x.shape[0])
    step = max(1, _CHECK_BLOCK_ENTRIES // max(1, math.prod(int(d) for d in x.shape[1:])))
    return all(bool(xp.all(xp.isfinite(x[start:min(n, start + step), ...]))) for start in range(0, n, step))


#: Relative tolerance of the check that ``hessian_diag`` is the mean of the samples.
SAMPLES_MEAN_RTOL = 1e-6
#: Entries (samples of a block of rows) compared at once by :func:`_check_samples_mean`.
_CHECK_BLOCK_ENTRIES = 1 << 16


def _check_samples_mean(layer: str, diag: Any, samples: Any) -> None:
    """Require ``mean_k samples[k] == diag`` up to rounding.

    The standard errors linearize every measure around ``diag`` and take the
    spread of the samples around it; samples of another quantity (sums instead of
    means, another layer, another layout) would give a confident, wrong error.
    The comparison runs in float64 a block of rows at a time: no float64 copy of the
    samples (``K`` times the layer) is ever formed.
    """
    try:
        xp = array_api_compat.array_namespace(samples, diag)
    except TypeError:  # two libraries: compare on the host
        samples, diag = np.asarray(to_numpy(samples)), np.asarray(to_numpy(diag))
        xp = namespace_of(samples)
    # Rounding of the mean in the arrays' own precision is allowed for.
    eps = max(float(xp.finfo(samples.dtype).eps), float(xp.finfo(diag.dtype).eps))
    k, out = int(samples.shape[0]), int(diag.shape[0])
    # Kernel-summed samples (K, out, in, 1, ...) are compared with the diagonal's kernel sums.
    summed = tuple(samples.shape[1:]) != tuple(diag.shape)
    per_row = math.prod(int(d) for d in diag.shape[1:])
    rows = max(1, _CHECK_BLOCK_ENTRIES // max(1, k * per_row))

    def blocks() -> Iterator[tuple[Any, Any, Any]]:
        """``(samples, diagonal, namespace)`` of each block of rows, in float64."""
        for start in range(0, out, rows):
            S, _ = as_float64(samples[:, start:min(out, start + rows), ...], xp)
            D, ns = as_float64(diag[start:min(out, start + rows), ...], xp)
            if summed:
                D = ns.reshape(ns.sum(ns.reshape(D, (D.shape[0], D.shape[1], -1)), axis=2), tuple(S.shape[1:]))
            yield S, D, ns

    def largest(ns: Any, x: Any) -> float:
        return max(to_float(ns.max(x)), -to_float(ns.min(x)))  # max |x| without an abs() copy

    s_max = d_max = 0.0
    for S, D, ns in blocks():
        s_max, d_max = max(s_max, largest(ns, S)), max(d_max, largest(ns, D))
    if max(s_max, d_max) == 0.0:
        return
    # Units of the largest magnitude (a power of two): samples near the float64
    # limits neither overflow in the mean nor underflow in the bound.
    unit = 2.0 ** -math.frexp(max(s_max, d_max))[1]
    error = max(largest(ns, ns.mean(S * unit, axis=0) - D * unit) for S, D, ns in blocks())
    bound = SAMPLES_MEAN_RTOL * d_max * unit + 8.0 * k * eps * s_max * unit
    if not error <= bound:
        raise ValueError(
            f"Layer {layer!r}: hessian_diag must be the mean over the K={k} estimates in "
            f"hessian_diag_samples, but they differ by up to {error / unit:.3g} (allowed: "
            f"{SAMPLES_MEAN_RTOL:g} of max|hessian_diag| plus rounding, {bound / unit:.3g}). Pass "
            "hessian_diag=samples.mean(axis=0), with the samples as (K, *weight.shape) in the same "
            "canonical layout."
        )
