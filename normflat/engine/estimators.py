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

``ggn-topk`` keeps ``1 + K`` sums (:attr:`AnalysisOptions.shared_group`): sum 0 is the
exact top-class part, shared, and ``groups_k = (sums_0 + sums_k) / examples``, so the
spread of the groups is that of the sampled part alone (method §6.2).

With ``estimator="auto"`` the number of sums is known only once a backend has seen
the classes: :func:`init` leaves it open and the first contribution fixes it.

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

    groups: int | None
    sums: list[Any] = field(default_factory=list)
    #: Layers whose sums the state allocated itself (from the second contribution on), which it
    #: may then add to in place: a caller's first contribution is never written into, and the
    #: sums are not copied on every batch.
    owned: set = field(default_factory=set)

    def add(self, layer: int, value: Any) -> None:
        """Add one contribution ``(K, *shape)`` to layer ``layer``'s sums (in place)."""
        update(self, layer, value)


def init(n_layers: int, options: AnalysisOptions) -> SumState:
    """Empty sums for ``n_layers`` layers (``K'`` sums each, open for ``"auto"``)."""
    return SumState(None if options.estimator == "auto" else options.state_groups, [None] * n_layers)


def update(state: SumState, layer: int, value: Any) -> SumState:
    """Add ``value`` (``(K', *shape)``) to the sums of ``layer``; returns ``state``."""
    if state.groups is None:
        state.groups = int(value.shape[0])
    if int(value.shape[0]) != state.groups:
        raise ValueError(f"estimator contribution has {value.shape[0]} groups, expected {state.groups}")
    current = state.sums[layer]
    if current is None:
        state.sums[layer] = value
    elif layer in state.owned:
        current += value  # in place for numpy and torch; a new array for JAX and TensorFlow
        state.sums[layer] = current
    else:
        state.sums[layer] = current + value
        state.owned.add(layer)
    return state


def divisors(options: AnalysisOptions, examples: int) -> np.ndarray:
    """Per-group divisors ``examples · m_k`` turning sums into group estimates."""
    k = options.groups
    if options.estimator == "hutchinson":
        return examples * group_counts(options.samples, k).astype(np.float64)
    return np.full(k, float(examples))


def finalize(state: SumState, options: AnalysisOptions, examples: int, zeros: Callable[[int], Any],
             all_finite: Callable[[Any], bool], names: list[str], with_groups: bool = True) -> list[tuple[Any, Any]]:
    """Group estimates and their mean per layer.

    Args:
        state: The accumulated sums.
        options: The analysis options, with ``"auto"`` resolved (the backend's).
        examples: Total number of terms of the mean loss over all ranks (samples, or
            the counted tokens of token logits, method §6.3).
        zeros: ``layer -> (K, *shape)`` zeros for a layer that never got a
            contribution (it does not influence the loss: its curvature is 0).
        all_finite: Backend's finiteness test.
        names: Layer names for the error message.
        with_groups: Whether the group estimates are wanted (``False``: only their
            mean, formed with fewer operations; ``groups`` is then ``None``).

    Returns:
        ``[(diag, groups or None)]`` per layer: ``diag`` a native array in the native
        shape, ``groups`` a list of ``K`` such arrays (or ``None`` when ``K = 1``).

    Raises:
        ValueError: If a diagonal is not finite.
    """
    div = divisors(options, examples)
    k_groups = options.groups
    offset = 1 if options.shared_group else 0
    out = []
    for i, sums in enumerate(state.sums):
        if sums is None:
            sums = zeros(i)
        if int(sums.shape[0]) != k_groups + offset:
            raise ValueError(f"Layer {names[i]!r}: {sums.shape[0]} estimator sums, expected {k_groups + offset}")
        shared = sums[0] if offset else None
        if not with_groups and k_groups > 1 and bool(np.all(div == div[0])):
            total = sums[offset]
            for k in range(1, k_groups):
                total = total + sums[k + offset]
            diag = total / float(div[0] * k_groups)
            if shared is not None:
                diag = diag + shared / float(div[0])
            _check_finite(diag, all_finite, names[i])
            out.append((diag, None))
            continue
        group_list = []
        for k in range(k_groups):
            total = sums[k + offset] if shared is None else shared + sums[k + offset]
            group_list.append(total / float(div[k]))
        diag = group_list[0]
        for g in group_list[1:]:
            diag = diag + g
        if k_groups > 1:
            diag = diag / float(k_groups)
        _check_finite(diag, all_finite, names[i])
        out.append((diag, None if k_groups == 1 or not with_groups else group_list))
    return out


def _check_finite(diag: Any, all_finite: Callable[[Any], bool], name: str) -> None:
    if not all_finite(diag):
        raise ValueError(
            f"Layer {name!r}: the Hessian diagonal is not finite (an overflow: huge weights or "
            "inputs, or a loss that is NaN/inf). Check the model and the data, or compute in float64."
        )
