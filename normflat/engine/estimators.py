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

**Kernel sums of the groups** (``kernel_axes``): the measures see the curvature of a
layer only through its kernel sums ``A_ij = Σ_k H_ijk`` (method §3), so for a layer with
kernel axes the state keeps its ``K'`` sums as kernel sums (axes of size 1) and the
diagonal's numerator at full size, one array: ``Σ_s c_s sums_s`` with the weights
:func:`mean_weights`, so that ``diag = Σ_s c_s sums_s / divisor_0``. A 3×3 convolution then
holds ``1 + K'/9`` arrays of its size instead of ``K'`` (method §6.2, memory of the groups).

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

__all__ = ["SumState", "init", "update", "finalize", "divisors", "mean_weights", "state_entries"]


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
    #: ``layer -> kernel axes`` of one group's array (the layout the backend adds in, axis 0
    #: its first axis after the groups), asked at a layer's first contribution; a layer with
    #: kernel axes keeps its groups as kernel sums. ``None``: no layer does.
    kernel_axes: Callable[[int], tuple[int, ...]] | None = None
    #: For those layers, once they have a contribution: the diagonal's full-size numerator
    #: ``Σ_s c_s sums_s`` (:func:`mean_weights`); ``sums`` then holds the kernel sums.
    means: dict = field(default_factory=dict)
    _axes: dict = field(default_factory=dict, repr=False)
    #: The options with ``"auto"`` resolved (the backend's), for :func:`mean_weights`;
    #: called at a kernel-summed layer's first contribution.
    resolved: Callable[[], AnalysisOptions] | None = None

    def add(self, layer: int, value: Any, owned: bool = False) -> None:
        """Add one contribution ``(K, *shape)`` to layer ``layer``'s sums (in place).

        ``owned``: ``value`` is a fresh array the state may keep and write into.
        """
        update(self, layer, value, owned)

    def accumulator(self, layer: int) -> Any:
        """The layer's running sums when a kernel may add into them in place (the state owns
        them, numpy or torch, not an exact layer's single sum), else ``None``."""
        sums = self.sums[layer]
        if (sums is None or layer not in self.owned or layer in self.exact or self.axes(layer)
                or not native.mutable(sums)):
            return None
        return sums

    def kernel_accumulator(self, layer: int) -> tuple[Any, Any] | None:
        """A kernel-summed layer's running ``(numerator, kernel sums)`` (:attr:`means`,
        :attr:`sums`) when a kernel may add into them in place (the state owns them, numpy or
        torch), else ``None``: its first contribution goes through :meth:`add`."""
        if layer not in self.means or layer not in self.owned or not native.mutable(self.means[layer]):
            return None
        return self.means[layer], self.sums[layer]

    def add_sums(self, layer: int, value: Any, sums: int, owned: bool = False) -> None:
        """Add a backend's contribution where it keeps ``sums`` per layer
        (:attr:`AnalysisOptions.sum_groups`): ``(sums, ...)`` as :meth:`add`, or, where ``sums > 1``,
        an exact layer's one shared sum ``(1, ...)`` as :meth:`add_exact` (a ``ggn-topk`` head whose
        kernel returns only its exact group 0)."""
        if int(value.shape[0]) == 1 and sums > 1:
            self.add_exact(layer, value, owned)
        else:
            self.add(layer, value, owned)

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
        if self.compacted(layer):
            # Kernel-summed groups: the shared sum's weight in the mean is 1 (mean_weights).
            self.means[layer] = _accumulate(self.means[layer], value[0])
            reduced = native.kernel_sums(value[0:1], self.axes(layer))
            if native.mutable(current):
                current[0] += reduced[0]
            else:
                self.sums[layer] = _with_first(current, current[0] + reduced[0])
            return
        if layer in self.owned and native.mutable(current):
            current[0] += value[0]
            return
        self.sums[layer] = _with_first(current, current[0] + value[0])
        self.owned.add(layer)

    def axes(self, layer: int) -> tuple[int, ...]:
        """The kernel axes over which ``layer``'s group sums are kept summed (``()``: none)."""
        if self.kernel_axes is None:
            return ()
        if layer not in self._axes:
            # One group (ggn-topk with one draw: K' = 2 sums, no group estimates) keeps its sums.
            grouped = self.resolved is None or self.resolved().groups > 1
            self._axes[layer] = tuple(self.kernel_axes(layer)) if grouped else ()
        return self._axes[layer]

    def compacted(self, layer: int) -> bool:
        """Whether ``layer``'s sums are kernel sums beside a full-size :attr:`means` entry."""
        return layer in self.means

    def weights(self) -> np.ndarray:
        """:func:`mean_weights` of the resolved options."""
        assert self.resolved is not None
        return mean_weights(self.resolved())

    def expand_exact(self, layer: int, zeros: Any) -> None:
        """Give an exact layer's single shared sum the full ``(K', ...)`` form (zeros for the
        sampled sums), kernel-summed where the layer's groups are: every rank of a distributed
        run then holds the same shapes."""
        current = self.sums[layer]
        self.exact.discard(layer)
        if self.axes(layer):
            self.sums[layer] = None
            self.owned.discard(layer)
            update(self, layer, native.concat([current, zeros[1:]]), owned=True, check=False)
        else:
            self.sums[layer] = native.concat([current, zeros[1:]])
            self.owned.add(layer)


def _accumulate(total: Any, part: Any) -> Any:
    """``total + part``, in place where the library allows (``total`` is the state's own) and
    ``part`` does not hold more precision (a float32 first contribution, then float64 ones)."""
    if native.mutable(total) and total.dtype == part.dtype:
        total += part
        return total
    return total + part


def mean_weights(options: AnalysisOptions) -> np.ndarray:
    """Weights ``c_s`` of the ``K'`` sums with ``diag = Σ_s c_s sums_s / divisor_0``.

    Without a shared sum ``diag = (1/K) Σ_k sums_k / (n m_k)``, so ``c_k = m_0 / (K m_k)``;
    with ``ggn-topk``'s shared sum 0, ``diag = (sums_0 + (1/K) Σ_k sums_k) / n``: ``c =
    (1, 1/K, ..., 1/K)``.
    """
    k = options.groups
    div = divisors(options, 1)
    sampled = div[0] / (k * div)
    return np.concatenate([[1.0], sampled]) if options.shared_group else sampled


def state_entries(options: AnalysisOptions, layers: list[tuple[int, int]]) -> int:
    """Entries the state holds at its peak, for layers given as ``(size, kernel size)``.

    ``options.sum_groups`` sums per weight; where the group estimates are wanted, a layer
    whose kernel size is above 1 and whose backend reports its kernel axes holds one
    full-size numerator and ``K'`` kernel sums instead, plus, while one contribution is added,
    its ``K'`` full-size squares (those of one layer at a time; an upper bound where the
    backend's rule adds one group's squares at a time, as torch's convolutions do).
    """
    s = options.sum_groups
    if not (options.group_estimates and options.groups > 1):
        return s * sum(size for size, _ in layers)
    total, transient = 0, 0
    for size, kernel in layers:
        if kernel > 1:
            total += size + s * (size // kernel)
            transient = max(transient, s * size)
        else:
            total += s * size
    return total + transient


def _with_first(array: Any, first: Any) -> Any:
    """``array`` with its first entry along axis 0 replaced (a new array, any library)."""
    return native.concat([first[None], array[1:]])


def init(n_layers: int, options: AnalysisOptions, kernel_axes: Callable[[int], tuple[int, ...]] | None = None,
         resolved: Callable[[], AnalysisOptions] | None = None) -> SumState:
    """Empty sums for ``n_layers`` layers (``K'`` sums each, open for ``"auto"``).

    Args:
        n_layers: Number of layers.
        options: The validated options.
        kernel_axes: ``layer -> axes``: the kernel axes of one group's array of ``layer``
            (the layout the backend adds in; its ``canonical`` must accept them with size 1),
            over which the group sums may be kept summed; asked at the layer's first
            contribution. Used only when the group estimates are wanted.
        resolved: The options with ``"auto"`` resolved (the backend's), when they may
            differ from ``options``; default ``options``.
    """
    # Pooled sums (options.pooled) may come from a backend that pools or one that does not:
    # the first contribution fixes their number, and finalize takes the mean of either.
    open_count = options.estimator == "auto" or options.pooled
    return SumState(None if open_count else options.state_groups, [None] * n_layers,
                    kernel_axes=kernel_axes if options.group_estimates else None,
                    resolved=resolved or (lambda: options))


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
            state.expand_exact(layer, native.zeros_like(value))
            current = state.sums[layer]
    if int(value.shape[0]) > 1 and state.axes(layer):
        return _update_kernel_sums(state, layer, value)
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


def _update_kernel_sums(state: SumState, layer: int, value: Any) -> SumState:
    """Add ``value`` to a kernel-summed layer: its weighted sum to :attr:`SumState.means`,
    its kernel sums to the sums (``value`` itself is not kept)."""
    axes = state.axes(layer)
    compact = getattr(value, "compact", None)  # a backend's container may do both in one call
    if compact is not None:
        part, reduced = compact(state.weights(), axes)
    else:
        part, reduced = native.weighted_sum(value, state.weights()), native.kernel_sums(value, axes)
    if layer not in state.means:
        state.means[layer], state.sums[layer] = part, reduced
        state.owned.add(layer)  # both are new arrays
    else:
        state.means[layer] = _accumulate(state.means[layer], part)
        state.sums[layer] = _accumulate(state.sums[layer], reduced)
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
        means = state.means.pop(i, None)
        if means is not None:
            # Kernel-summed groups (SumState.kernel_axes): the full-size diagonal from its own
            # numerator, the group estimates from the kernel sums.
            diag = _divided(means, float(div[0]), in_place=i in state.owned)
            del means
            _check_finite(diag, all_finite, names[i])
            groups = (_group_estimates(sums, offset, div, even, in_place=i in state.owned and native.mutable(sums))
                      if with_groups else None)
            out.append((diag, groups))
            continue
        if sums is None:
            sums = zeros(i)
        # One sum: its mean formed in the sums' own memory where the state owns them (a view of
        # a one-sum array holds nothing more); a fresh weight-sized array costs its page faults
        # (on the MLP of the benchmarks, dividing into a new first-layer array took 0.7 ms, seven
        # times the division itself).
        alone = int(sums.shape[0]) == 1 and i in state.owned and native.mutable(sums)
        if offset and i in state.exact:
            diag = sums[0] / float(div[0])  # exact: every group estimate is the mean
            _check_finite(diag, all_finite, names[i])
            out.append((diag, _repeat(diag, k_groups) if with_groups and k_groups > 1 else None))
            continue
        if options.pooled and int(sums.shape[0]) == 1:
            # The backend pooled every group into one sum (options.pooled, losses.pool_signals).
            diag = _divided(sums[0], float(div[0]), alone)
            _check_finite(diag, all_finite, names[i])
            out.append((diag, None))
            continue
        if int(sums.shape[0]) == 1 + offset and k_groups == 1:
            # One group (and ggn-topk's shared sum): one mean.
            diag = (sums[0] + sums[1]) / float(div[0]) if offset else _divided(sums[0], float(div[0]), alone)
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
    state.means.clear()
    return out


def _divided(array: Any, divisor: float, in_place: bool) -> Any:
    """``array / divisor``, in ``array``'s memory when the state owns it and the library allows."""
    if in_place and native.mutable(array):
        array /= divisor
        return array
    return array / divisor


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
