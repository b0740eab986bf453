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

from normflat.engine import native
from normflat.engine.options import AnalysisOptions
from normflat.engine.random import group_counts

__all__ = ["SumState", "init", "update", "finalize", "divisors"]


@dataclass
class SumState:
    """Per-layer sums of ``K`` group estimates; ``None`` until a layer gets a contribution."""

    groups: int | None
    sums: list[Any] = field(default_factory=list)
    #: Layers whose sums the state may write into: allocated by the state itself (from the
    #: second contribution on), or handed over by a backend as ``owned`` (a fresh array
    #: nobody else holds). A caller's other contributions are never written into, and the
    #: sums are not copied on every batch.
    owned: set = field(default_factory=set)
    #: Layers whose every contribution so far is exact (``ggn-topk``'s dense head): only the
    #: shared sum 0 is kept, ``(1, *shape)``, instead of ``1 + K`` sums of which ``K`` are zero.
    exact: set = field(default_factory=set)

    def add(self, layer: int, value: Any, owned: bool = False) -> None:
        """Add one contribution ``(K, *shape)`` to layer ``layer``'s sums (in place).

        ``owned``: ``value`` is a fresh array the state may keep and write into.
        """
        update(self, layer, value, owned)

    def accumulator(self, layer: int) -> Any:
        """The layer's running sums when a kernel may add into them in place (the state owns
        them, numpy or torch, not an exact layer's single sum), else ``None``."""
        sums = self.sums[layer]
        if sums is None or layer not in self.owned or layer in self.exact or not native.mutable(sums):
            return None
        return sums

    def add_exact(self, layer: int, value: Any, owned: bool = False) -> None:
        """Add an exact contribution ``(1, *shape)`` to the shared sum 0 of a ``ggn-topk``
        layer (its sampled sums get nothing)."""
        current = self.sums[layer]
        if current is None:
            self.sums[layer] = value
            self.exact.add(layer)
            if owned:
                self.owned.add(layer)
            return
        if layer in self.exact:
            update(self, layer, value, owned, check=False)
            return
        if layer in self.owned and native.mutable(current):
            current[0] += value[0]
            return
        self.sums[layer] = _with_first(current, current[0] + value[0])
        self.owned.add(layer)


def _with_first(array: Any, first: Any) -> Any:
    """``array`` with its first entry along axis 0 replaced (a new array, any library)."""
    return native.concat([first[None], array[1:]])


def init(n_layers: int, options: AnalysisOptions) -> SumState:
    """Empty sums for ``n_layers`` layers (``K'`` sums each, open for ``"auto"``)."""
    # Pooled sums (options.pooled) may come from a backend that pools or one that does not:
    # the first contribution fixes their number, and finalize takes the mean of either.
    open_count = options.estimator == "auto" or options.pooled
    return SumState(None if open_count else options.state_groups, [None] * n_layers)


def update(state: SumState, layer: int, value: Any, owned: bool = False, check: bool = True) -> SumState:
    """Add ``value`` (``(K', *shape)``) to the sums of ``layer``; returns ``state``.

    ``owned``: ``value`` is a fresh array the state may keep and write into.
    """
    current = state.sums[layer]
    if check:
        if state.groups is None:
            state.groups = int(value.shape[0])
        if int(value.shape[0]) != state.groups:
            raise ValueError(f"estimator contribution has {value.shape[0]} groups, expected {state.groups}")
        if layer in state.exact:
            # A layer exact so far gets a full contribution (its fast rule gave way to the
            # generic path): its shared sum becomes sum 0 of 1 + K.
            current = native.concat([current, native.zeros_like(value[1:])])
            state.sums[layer] = current
            state.exact.discard(layer)
            state.owned.add(layer)
    if current is None:
        state.sums[layer] = value
        if owned:
            state.owned.add(layer)
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
    """Group estimates and their mean per layer; consumes ``state``.

    The sums the state owns are turned into the group estimates in place (numpy and
    torch) and each layer's sums are released from the state as it is done, so the
    peak is the sums plus one mean per layer, not a second copy of every group.

    Args:
        state: The accumulated sums (released by this call: do not finalize it twice).
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
        shape, ``groups`` the ``K`` group estimates (``None`` when ``K = 1``): a
        ``(K, *shape)`` array in the sums' memory where the state owns mutable sums
        (numpy, torch), else a list of ``K`` arrays. An exact layer's groups
        (:meth:`SumState.add_exact`) are its mean repeated (a broadcast view where the
        library has one).

    Raises:
        ValueError: If a diagonal is not finite.
    """
    div = divisors(options, examples)
    k_groups = options.groups
    offset = 1 if options.shared_group else 0
    even = bool(np.all(div == div[0]))
    out = []
    for i in range(len(state.sums)):
        sums, state.sums[i] = state.sums[i], None
        if sums is None:
            sums = zeros(i)
        if offset and i in state.exact:
            diag = sums[0] / float(div[0])  # exact: every group estimate is the mean
            _check_finite(diag, all_finite, names[i])
            out.append((diag, _repeat(diag, k_groups) if with_groups and k_groups > 1 else None))
            continue
        if options.pooled and int(sums.shape[0]) == 1:
            # The backend pooled every group into one sum (options.pooled, losses.pool_signals).
            diag = sums[0] / float(div[0])
            _check_finite(diag, all_finite, names[i])
            out.append((diag, None))
            continue
        if int(sums.shape[0]) == 1 + offset and k_groups == 1:
            # One group (and ggn-topk's shared sum): one mean.
            diag = (sums[0] + sums[1] if offset else sums[0]) / float(div[0])
            _check_finite(diag, all_finite, names[i])
            out.append((diag, None))
            continue
        if int(sums.shape[0]) != k_groups + offset:
            raise ValueError(f"Layer {names[i]!r}: {sums.shape[0]} estimator sums, expected {k_groups + offset}")
        if not with_groups and even:
            diag = sums[offset] + sums[offset + 1]
            for k in range(2, k_groups):
                diag += sums[k + offset]  # in place for numpy and torch (diag is new)
            if offset:
                diag /= float(k_groups)
                diag += sums[0]
                diag /= float(div[0])
            else:
                diag /= float(div[0] * k_groups)
            _check_finite(diag, all_finite, names[i])
            out.append((diag, None))
            continue
        groups = _group_estimates(sums, offset, div, even, in_place=i in state.owned and native.mutable(sums))
        del sums
        diag = groups[0] + groups[1]
        for k in range(2, k_groups):
            diag += groups[k]
        diag /= float(k_groups)
        _check_finite(diag, all_finite, names[i])
        out.append((diag, groups if with_groups else None))
    state.owned.clear()
    state.exact.clear()
    return out


def _group_estimates(sums: Any, offset: int, div: np.ndarray, even: bool, in_place: bool) -> Any:
    """Group estimates ``(sums_0 + sums_k) / div_k`` (or ``sums_k / div_k`` without a shared
    sum): a ``(K, *shape)`` view of the sums' own memory when ``in_place``, else a list of
    ``K`` new arrays."""
    k_groups = int(sums.shape[0]) - offset
    if in_place:
        groups = sums[offset:]
        if offset:
            groups += sums[0][None]
        if even:  # every group has the same divisor
            groups /= float(div[0])
        else:
            for k in range(k_groups):
                groups[k] /= float(div[k])
        return groups
    # Indexing by group only: a backend's sums may be a sequence of K arrays (JAX's GroupSums).
    parts = []
    for k in range(k_groups):
        total = sums[k + offset] if not offset else sums[0] + sums[k + offset]
        parts.append(total / float(div[k]))
    return parts


def _repeat(array: Any, count: int) -> Any:
    """``(count, *shape)``: ``array`` repeated along a new axis 0 (a view in numpy and torch)."""
    mod = native.library(array)
    if mod == "torch":
        return array[None].expand(count, *array.shape)
    if mod == "numpy":
        return np.broadcast_to(array[None], (count, *array.shape))
    return [array] * count


def _check_finite(diag: Any, all_finite: Callable[[Any], bool], name: str) -> None:
    if not all_finite(diag):
        raise ValueError(
            f"Layer {name!r}: the Hessian diagonal is not finite (an overflow: huge weights or "
            "inputs, or a loss that is NaN/inf). Check the model and the data, or compute in float64."
        )
