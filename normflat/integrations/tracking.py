"""The framework-free core shared by every training-time tracker.

:class:`Tracker` holds what all integrations have in common: the analysis data
(a fixed subset when ``max_batches`` is given), the schedule (every N epochs or
every N optimizer steps), the :func:`normflat.analyze` options, which values to
log, and the :class:`~normflat.integrations.history.TrackingHistory`. The
framework modules (``keras``, ``lightning``, ``huggingface``, ``torch``,
``jax``) only decide *when* the hooks fire and *where* the values are logged.

An analysis never changes the training run. The backends leave the model as
it was (weights, modes, gradients, buffers) and draw from no global random
stream; normflat never saves or restores a global stream either. What is left is
the data: iterating a ``DataLoader`` draws its base seed from torch's global
generator, so loaders are read without their sampler (:func:`iterate_quietly`).
A data object of the user's own that draws from ``random`` or ``numpy.random``
when iterated does so as it would anywhere; pass ``max_batches`` to draw the
fixed subset once.
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

from normflat.core.constants import MEASURES
from normflat.integrations.history import HistoryEntry, TrackingHistory

__all__ = ["Tracker", "LoopTracker", "iterate_quietly", "LOGGABLE"]

#: The values a tracker can log: the four totals of method §4.
LOGGABLE = MEASURES


def iterate_quietly(data: Any) -> Iterator[Any]:
    """Iterate ``data`` without drawing from any global random stream where that is possible.

    Iterating a ``torch.utils.data.DataLoader`` draws its base seed (and a shuffling
    sampler's permutation) from torch's global generator, which would change the
    training run's random stream. The measures are sums over batches, so the order
    does not matter: a loader over a map-style dataset whose sampler visits every
    sample once (sequential or random order) or a fixed subset of it is read in index
    order, in this process, with the loader's batch size and collate function. Other
    data is iterated as it is (it is the user's object; normflat itself draws nothing).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        from torch.utils import data as tud

        if isinstance(data, tud.DataLoader) and not isinstance(data.dataset, tud.IterableDataset):
            indices = _sampler_indices(data, tud)
            if indices is not None:
                return _sequential_batches(data, indices)
    return iter(data)


def _is_torch_loader(data: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.utils.data.DataLoader)


def _sampler_indices(loader: Any, tud: Any) -> list[int] | None:
    sampler = loader.sampler
    n = len(loader.dataset)
    if isinstance(sampler, tud.SequentialSampler):
        return list(range(n))
    if isinstance(sampler, tud.RandomSampler) and not sampler.replacement and sampler.num_samples == n:
        return list(range(n))
    if isinstance(sampler, tud.SubsetRandomSampler):
        return sorted(int(i) for i in sampler.indices)
    return None


def _sequential_batches(loader: Any, indices: list[int]) -> Iterator[Any]:
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 1
    for start in range(0, len(indices), size):
        chunk = indices[start:start + size]
        if loader.drop_last and len(chunk) < size:
            return
        yield loader.collate_fn([loader.dataset[i] for i in chunk])


def _check_every(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (or None), got {value!r}.")
    return value


def _is_single_pair(data: Any) -> bool:
    """``(x, y)`` of arrays, or a mapping with ``x`` and ``y``: one batch, not an iterable of batches."""
    if isinstance(data, dict) and "x" in data and "y" in data:
        return True
    return isinstance(data, (tuple, list)) and len(data) == 2 and hasattr(data[1], "shape")


class Tracker:
    """Schedule, options and history of a training-time analysis (framework-free).

    The framework integrations wrap one of these; it is public so that a loop
    normflat has no helper for can use it directly (call :meth:`due_step` /
    :meth:`due_epoch`, then :meth:`run`).

    Args:
        data: The analysis data, as for :func:`normflat.analyze`: an ``(x, y)``
            pair, a DataLoader, a ``tf.data.Dataset``, a list of batches.
        every_n_epochs: Analyze after every N-th epoch (after epochs N, 2N, ...).
        every_n_steps: Analyze after every N-th optimizer step (after steps N, 2N,
            ...). Give at most one of the two; neither means ``every_n_epochs=1``.
        max_batches: Analyze on the first N batches of ``data`` only. They are
            drawn once, at the first analysis, and reused: every analysis sees the
            same fixed subset, even from a shuffling loader.
        log: Which totals to log (any of :data:`normflat.MEASURES`); default all four.
        per_layer: Also log each layer's normalized sharpness, as
            ``<prefix>normalized_sharpness/<layer>``.
        prefix: Prepended to every logged key, e.g. ``"val_"``.
        keep_reports: Keep every :class:`~normflat.Report` in the history (set
            ``False`` for long runs of large models: the history then holds the
            totals and per-layer values only).
        **analyze_options: Passed to :func:`normflat.analyze` (``estimator``,
            ``loss``, ``samples``, ``seed``, ``on_unsupported``, ``chunk_size``, ...).
            The progress bar is off unless ``progress=True`` is given.

    Attributes:
        history: The :class:`~normflat.integrations.history.TrackingHistory`.
    """

    def __init__(self, data: Any, *, every_n_epochs: int | None = None, every_n_steps: int | None = None,
                 max_batches: int | None = None, log: Sequence[str] | str | None = None, per_layer: bool = False,
                 prefix: str = "", keep_reports: bool = True, **analyze_options: Any) -> None:
        if data is None:
            raise ValueError("The tracker needs the analysis data first, e.g. SharpnessCallback(val_loader, ...).")
        every_n_epochs = _check_every("every_n_epochs", every_n_epochs)
        every_n_steps = _check_every("every_n_steps", every_n_steps)
        if every_n_epochs is not None and every_n_steps is not None:
            raise ValueError("Give every_n_epochs or every_n_steps, not both: an analysis is scheduled by one clock.")
        if every_n_epochs is None and every_n_steps is None:
            every_n_epochs = 1
        _check_every("max_batches", max_batches)
        if isinstance(log, str):
            log = (log,)
        log = tuple(LOGGABLE) if log is None else tuple(log)
        unknown = [name for name in log if name not in LOGGABLE]
        if unknown:
            raise ValueError(f"log={unknown!r}: unknown value(s); choose from {', '.join(LOGGABLE)}.")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}.")
        if "model" in analyze_options:
            raise TypeError("The tracker takes the analysis data as its first argument; the model comes from the "
                            "training loop at each analysis, so there is no model= option.")
        self.data = data
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.max_batches = max_batches
        self.log = log
        self.per_layer = bool(per_layer)
        self.prefix = prefix
        self.keep_reports = bool(keep_reports)
        self.analyze_options = {"progress": False, **analyze_options}
        self.history = TrackingHistory()
        self._subset: list[Any] | None = None
        self._last_step: int | None = None

    # ------------------------------------------------------------------ schedule

    @property
    def by_steps(self) -> bool:
        """Whether the schedule counts optimizer steps (else epochs)."""
        return self.every_n_steps is not None

    def due_step(self, step: int) -> bool:
        """Whether the analysis is due after optimizer step ``step`` (1-based count of
        steps done): at the first report of a step at or past the next multiple of
        ``every_n_steps``. A step is analyzed once, also when several hooks report it
        (gradient accumulation calls the batch hook several times per step), and a
        multiple is not missed when hooks report every k-th step only (Keras
        ``steps_per_execution``)."""
        n = self.every_n_steps
        if n is None or step <= 0:
            return False
        return step // n > (self._last_step or 0) // n

    def due_epoch(self, epoch: int) -> bool:
        """Whether the analysis is due after the zero-based epoch ``epoch``."""
        return self.every_n_epochs is not None and (epoch + 1) % self.every_n_epochs == 0

    # ------------------------------------------------------------------ analysis

    def analysis_data(self, transform: Callable[[Any], Any] | None = None) -> Any:
        """The data an analysis uses: the fixed subset when ``max_batches`` is given.

        Args:
            transform: Applied to each batch as it is drawn (e.g. a move onto the
                model's device).
        """
        data = self.data
        if self.max_batches is not None and not _is_single_pair(data):
            if self._subset is None:
                # Drawn once: every later analysis sees the same batches.
                self._subset = list(itertools.islice(iterate_quietly(data), self.max_batches))
            data = self._subset
        if _is_torch_loader(data):
            data = _Quiet(data)
        if transform is not None and not _is_single_pair(data):
            return _Mapped(data, transform)
        if transform is not None:
            return transform(data)
        return data

    def analyze(self, model: Any, transform: Callable[[Any], Any] | None = None) -> Any:
        """:func:`normflat.analyze` of ``model`` on the analysis data. Returns the Report."""
        import normflat

        options = dict(self.analyze_options)
        if self.max_batches is not None:
            options["max_batches"] = self.max_batches
        return normflat.analyze(model, self.analysis_data(transform), **options)

    def record(self, report: Any, *, step: int, epoch: int | None) -> dict[str, float]:
        """Add ``report`` to the history; returns the values to log (prefixed keys)."""
        entry = HistoryEntry.from_report(report, step=step, epoch=epoch, keep_report=self.keep_reports)
        self.history.append(entry)
        self._last_step = step
        return self.metrics(entry)

    def run(self, model: Any, *, step: int, epoch: int | None,
            transform: Callable[[Any], Any] | None = None) -> dict[str, float]:
        """Analyze now, record, and return the values to log."""
        return self.record(self.analyze(model, transform), step=step, epoch=epoch)

    def metrics(self, entry: HistoryEntry) -> dict[str, float]:
        """The logged values of one entry: the chosen totals and, with
        ``per_layer=True``, each layer's normalized sharpness."""
        out = {self.prefix + name: entry.totals[name] for name in self.log}
        if self.per_layer:
            out.update({f"{self.prefix}normalized_sharpness/{k}": v for k, v in entry.layers.items()})
        return out

    def nan_metrics(self) -> dict[str, float]:
        """The logged keys with NaN values (an epoch that was not analyzed, in Keras)."""
        out = {self.prefix + name: math.nan for name in self.log}
        if self.per_layer and self.history:
            out.update({f"{self.prefix}normalized_sharpness/{k}": math.nan for k in self.history.layer_names})
        return out


class _Quiet:
    """Re-iterable view of ``data`` iterated with :func:`iterate_quietly`."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        return iterate_quietly(self.data)

    def __len__(self) -> int:
        return len(self.data)


class _Mapped:
    """An iterable applying ``fn`` to each batch of ``data`` (re-iterable when ``data`` is)."""

    def __init__(self, data: Iterable[Any], fn: Callable[[Any], Any]) -> None:
        self.data, self.fn = data, fn

    def __iter__(self) -> Iterator[Any]:
        return (self.fn(b) for b in self.data)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


class LoopTracker:
    """What the hand-written-loop helpers (plain torch, JAX) share: the options, an
    optional ``logger(metrics, step)`` and the history; subclasses add ``step``/``epoch_end``."""

    def __init__(self, data: Any, *, every_n_epochs: int | None = None, every_n_steps: int | None = None,
                 max_batches: int | None = None, log: Sequence[str] | str | None = None, per_layer: bool = False,
                 prefix: str = "", logger: Callable[[dict[str, float], int], Any] | None = None,
                 keep_reports: bool = True, **analyze_options: Any) -> None:
        if logger is not None and not callable(logger):
            raise TypeError(f"logger must be a callable logger(metrics, step), got {type(logger).__name__}.")
        self.tracker = Tracker(data, every_n_epochs=every_n_epochs, every_n_steps=every_n_steps,
                               max_batches=max_batches, log=log, per_layer=per_layer, prefix=prefix,
                               keep_reports=keep_reports, **analyze_options)
        self.logger = logger
        self._steps = 0

    @property
    def history(self) -> Any:
        """The analyses so far (a :class:`~normflat.integrations.history.TrackingHistory`)."""
        return self.tracker.history
