"""The estimator protocol: an ``(init, update, finalize)`` triple over per-layer sums.

Every estimator of every framework reduces to sums over samples of per-layer
arrays (method §6). For ``K`` independent group estimates (``K >= 2`` for the
stochastic estimators, see :attr:`AnalysisOptions.groups`) the state holds, per
layer, ``K`` sums in the layer's native shape:

``init(layers) -> state``
    empty sums;
``update(state, layer, value) -> state``
    adds one batch's ``(K, *shape)`` contribution (a backend's kernel output);
``finalize(state, examples) -> [(diag, groups)]``
    ``groups_k = sums_k / (examples · m_k)`` with ``m_k`` the probes of group ``k``
    (``hutchinson``; ``ggn-mc`` signals are already scaled by ``1/√m_k``), and
    ``diag = mean_k groups_k``: an unbiased estimate of the Hessian (or GGN)
    diagonal of the mean loss; ``groups`` is ``None`` when ``K = 1``.

The arithmetic uses only ``+``, ``/`` and indexing, so the sums stay in the
framework's array type and on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from normflat.engine.options import AnalysisOptions
from normflat.engine.random import group_counts

__all__ = ["SumState", "init", "update", "finalize", "divisors"]


@dataclass
class SumState:
    """Per-layer sums of ``K`` group estimates; ``None`` until a layer gets a contribution."""

    groups: int
    sums: list[Any] = field(default_factory=list)

    def add(self, layer: int, value: Any) -> None:
        """Add one contribution ``(K, *shape)`` to layer ``layer``'s sums (in place)."""
        update(self, layer, value)


def init(n_layers: int, options: AnalysisOptions) -> SumState:
    """Empty sums for ``n_layers`` layers."""
    return SumState(options.groups, [None] * n_layers)


def update(state: SumState, layer: int, value: Any) -> SumState:
    """Add ``value`` (``(K, *shape)``) to the sums of ``layer``; returns ``state``."""
    if int(value.shape[0]) != state.groups:
        raise ValueError(f"estimator contribution has {value.shape[0]} groups, expected {state.groups}")
    current = state.sums[layer]
    state.sums[layer] = value if current is None else current + value
    return state


def divisors(options: AnalysisOptions, examples: int) -> np.ndarray:
    """Per-group divisors ``examples · m_k`` turning sums into group estimates."""
    k = options.groups
    if options.estimator == "hutchinson":
        return examples * group_counts(options.samples, k).astype(np.float64)
    return np.full(k, float(examples))


def finalize(state: SumState, options: AnalysisOptions, examples: int, zeros: Callable[[int], Any],
             all_finite: Callable[[Any], bool], names: list[str]) -> list[tuple[Any, Any]]:
    """Group estimates and their mean per layer.

    Args:
        state: The accumulated sums.
        options: The analysis options.
        examples: Total number of terms of the mean loss over all ranks (samples, or
            the counted tokens of token logits, method §6.3).
        zeros: ``layer -> (K, *shape)`` zeros for a layer that never got a
            contribution (it does not influence the loss: its curvature is 0).
        all_finite: Backend's finiteness test.
        names: Layer names for the error message.

    Returns:
        ``[(diag, groups or None)]`` per layer: ``diag`` a native array in the native
        shape, ``groups`` a list of ``K`` such arrays (or ``None`` when ``K = 1``).

    Raises:
        ValueError: If a diagonal is not finite.
    """
    div = divisors(options, examples)
    out = []
    for i, sums in enumerate(state.sums):
        if sums is None:
            sums = zeros(i)
        group_list = [sums[k] / float(div[k]) for k in range(state.groups)]
        diag = group_list[0]
        for g in group_list[1:]:
            diag = diag + g
        if state.groups > 1:
            diag = diag / float(state.groups)
        if not all_finite(diag):
            raise ValueError(
                f"Layer {names[i]!r}: the Hessian diagonal is not finite (an overflow: huge weights or "
                "inputs, or a loss that is NaN/inf). Check the model and the data, or compute in float64."
            )
        out.append((diag, None if state.groups == 1 else group_list))
    return out
