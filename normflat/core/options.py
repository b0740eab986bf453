"""Options shared by every backend: names, validation and defaults (SPEC §6-7, §9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TypeVar

__all__ = [
    "ESTIMATORS",
    "LOSSES",
    "ON_UNSUPPORTED",
    "NSCE_EPS",
    "AnalysisOptions",
    "validate_options",
    "progress_bar",
    "limited",
]

#: Hessian-diagonal estimators (SPEC §6).
ESTIMATORS = ("ggn", "ggn-mc", "hutchinson", "exact")
#: Built-in losses (SPEC §7): normalized softmax cross-entropy and plain cross-entropy.
LOSSES = ("nsce", "ce")
#: What to do with a layer that has parameters but no registered extractor.
ON_UNSUPPORTED = ("error", "warn", "skip")
#: ε of the normalized softmax cross-entropy (SPEC §7).
NSCE_EPS = 1e-12
#: Default number of probes / Monte-Carlo draws of the stochastic estimators.
DEFAULT_SAMPLES = {"ggn-mc": 1, "hutchinson": 100}

T = TypeVar("T")


@dataclass(frozen=True)
class AnalysisOptions:
    """Validated options of ``analyze``/``hessian_diagonal``, passed to backends.

    Attributes:
        loss: ``"nsce"``, ``"ce"`` or a callable ``(logits, y) -> mean loss``.
        estimator: One of :data:`ESTIMATORS`.
        samples: Probes (hutchinson) or label draws per input (ggn-mc); ``None``
            for the deterministic estimators.
        seed: Seed of the stochastic estimators.
        max_batches: Use at most this many batches of the data (``None``: all).
        progress: Show a tqdm progress bar over batches.
        on_unsupported: ``"error"``, ``"warn"`` or ``"skip"``.
        temperature: ``τ`` of the normalized softmax cross-entropy.
    """

    loss: Any = "nsce"
    estimator: str = "ggn"
    samples: int | None = None
    seed: int = 0
    max_batches: int | None = None
    progress: bool = True
    on_unsupported: str = "warn"
    temperature: float = 1.0

    @property
    def loss_name(self) -> str:
        """Name recorded in reports: the built-in name or the callable's name."""
        if isinstance(self.loss, str):
            return self.loss
        return getattr(self.loss, "__name__", type(self.loss).__name__)


def validate_options(
    *,
    loss: Any = "nsce",
    estimator: str = "ggn",
    samples: int | None = None,
    seed: int = 0,
    max_batches: int | None = None,
    progress: bool = True,
    on_unsupported: str = "warn",
    temperature: float = 1.0,
) -> AnalysisOptions:
    """Check the common options and fill defaults.

    Raises:
        ValueError: For unknown names or out-of-range numbers, naming the choices.
        TypeError: For options of the wrong type.
    """
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"Unknown loss {loss!r}; choose one of {', '.join(map(repr, LOSSES))} or pass a "
                "callable (logits, y) -> mean loss."
            )
    elif not callable(loss):
        raise TypeError(f"loss must be a name {LOSSES} or a callable, got {type(loss).__name__}.")
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"Unknown estimator {estimator!r}; choose one of {', '.join(map(repr, ESTIMATORS))}."
        )
    if callable(loss) and estimator in ("ggn", "ggn-mc"):
        raise ValueError(
            f"estimator={estimator!r} needs the Hessian of the loss with respect to the logits, "
            "which normflat knows only for the built-in losses 'nsce' and 'ce'. With a custom "
            "loss callable use estimator='exact' or estimator='hutchinson'."
        )
    if on_unsupported not in ON_UNSUPPORTED:
        raise ValueError(
            f"Unknown on_unsupported={on_unsupported!r}; choose one of "
            f"{', '.join(map(repr, ON_UNSUPPORTED))}."
        )
    if samples is not None:
        if isinstance(samples, bool) or not isinstance(samples, int):
            raise TypeError(f"samples must be a positive int or None, got {samples!r}.")
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}.")
    if estimator in DEFAULT_SAMPLES and samples is None:
        samples = DEFAULT_SAMPLES[estimator]
    if estimator in ("ggn", "exact"):
        samples = None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    if max_batches is not None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}.")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}.")
    return AnalysisOptions(
        loss=loss,
        estimator=estimator,
        samples=samples,
        seed=seed,
        max_batches=max_batches,
        progress=bool(progress),
        on_unsupported=on_unsupported,
        temperature=float(temperature),
    )


def progress_bar(
    iterable: Iterable[T], *, enabled: bool, desc: str, total: int | None = None
) -> Iterator[T]:
    """Wrap ``iterable`` in a tqdm bar when ``enabled`` (tqdm is a core dependency)."""
    if not enabled:
        return iter(iterable)
    from tqdm.auto import tqdm

    return iter(tqdm(iterable, desc=desc, total=total, unit="batch", leave=False))


def limited(iterable: Iterable[T], max_batches: int | None) -> Iterator[T]:
    """Yield at most ``max_batches`` items."""
    for i, item in enumerate(iterable):
        if max_batches is not None and i >= max_batches:
            return
        yield item


