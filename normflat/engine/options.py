"""Options shared by every backend: names, validation and defaults (method §6, §7, §9).

Every framework receives the same validated :class:`AnalysisOptions`, so an option
means the same thing and a bad value gets the same error whatever the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, TypeVar

__all__ = [
    "check_flags",
    "ESTIMATORS",
    "GGN_ESTIMATORS",
    "LOSSES",
    "ON_UNSUPPORTED",
    "NSCE_EPS",
    "DEFAULT_SAMPLES",
    "DEFAULT_TOP_CLASSES",
    "MAX_GROUPS",
    "AnalysisOptions",
    "validate_options",
    "resolve_estimator",
    "adopt_estimator",
    "validate_solver_options",
    "progress_bar",
    "limited",
]

#: Hessian-diagonal estimators (method §6); ``"auto"`` is resolved per model by
#: :func:`resolve_estimator` once the number of classes is known.
ESTIMATORS = ("auto", "ggn", "ggn-topk", "ggn-mc", "hutchinson", "exact")
#: The estimators that back-propagate signals from the logits (GGN family).
GGN_ESTIMATORS = ("auto", "ggn", "ggn-topk", "ggn-mc")
#: Built-in losses (method §7): normalized softmax cross-entropy and plain cross-entropy.
LOSSES = ("nsce", "ce")
#: What to do with a layer that has parameters but no registered extractor.
ON_UNSUPPORTED = ("error", "warn", "skip")
#: ε of the normalized softmax cross-entropy (method §7).
NSCE_EPS = 1e-12
#: Default number of probes / Monte-Carlo draws of the stochastic estimators.
DEFAULT_SAMPLES = {"ggn-mc": 1, "hutchinson": 100, "ggn-topk": 10}
#: Default classes of each sample whose curvature ``ggn-topk`` takes exactly (method §6.2).
DEFAULT_TOP_CLASSES = 2
#: At most this many independent group estimates are kept for standard errors.
MAX_GROUPS = 10
#: ``ggn-topk`` keeps fewer: each group costs one more sum of squares per layer, which at
#: many classes costs as much as the draws themselves (method §6.2).
TOPK_MAX_GROUPS = 5

T = TypeVar("T")


@dataclass(frozen=True)
class AnalysisOptions:
    """Validated options of ``analyze``/``hessian_diagonal``, passed to backends.

    Attributes:
        loss: ``"nsce"``, ``"ce"`` or a callable ``(logits, y) -> mean loss``.
        estimator: One of :data:`ESTIMATORS`; ``"auto"`` until a backend knows the
            number of classes and calls :func:`resolve_estimator`.
        samples: Probes (hutchinson), label draws per input (ggn-mc), or draws of
            the classes outside the top ones (ggn-topk); ``None`` for the
            deterministic estimators.
        top_classes: ``ggn-topk`` (and ``auto``): classes of each sample (or token)
            whose curvature is taken exactly, the most probable ones; ``None`` for
            the other estimators.
        seed: Seed of the stochastic estimators.
        max_batches: Use at most this many batches of the data (``None``: all).
        progress: Show a tqdm progress bar over batches.
        on_unsupported: ``"error"``, ``"warn"`` or ``"skip"``.
        temperature: ``τ`` of the normalized softmax cross-entropy.
        ignore_index: Token label that is not counted in a sequence loss (method §6.3).
        output: What to take from a model output that is not an array (method §9):
            ``None`` (an array as is; ``.logits`` / ``["logits"]`` of a Hugging Face
            ``ModelOutput`` or a dict; the first entry of a tuple), a key or
            attribute name, a tuple index, or a callable ``output -> logits``.
        shift_labels: Whether token logits at position ``t`` predict the label at
            ``t + 1`` (a causal language model fed ``labels = input_ids``, as Hugging
            Face's own loss shifts them); ``None``: the backend decides (shifted for
            Hugging Face causal language models, not otherwise).
        sequence_signals: Token logits only (method §6.3): whether every back-propagated
            signal spans a whole sequence, each token's signal times an independent random
            sign (``True``: one back-propagation per signal and sequence), or one token
            (``False``: ``T`` per signal and sequence, each (token, signal) pair its own
            square); ``None``: per sequence for ``ggn-mc`` and ``ggn-topk``, per token for
            the exact ``ggn`` (:attr:`per_sequence`).
    """

    loss: Any = "nsce"
    estimator: str = "ggn"
    samples: int | None = None
    seed: int = 0
    top_classes: int | None = None
    max_batches: int | None = None
    progress: bool = True
    on_unsupported: str = "warn"
    temperature: float = 1.0
    ignore_index: int = -100
    output: Any = None
    shift_labels: bool | None = None
    sequence_signals: bool | None = None
    #: Whether the ``K`` group estimates are wanted (for standard errors). ``hessian_diagonal``
    #: needs only their mean: a backend may then pool the groups' sums (:attr:`pooled`).
    group_estimates: bool = True

    @property
    def pooled(self) -> bool:
        """Whether a backend may keep one sum per weight for all ``K`` groups (only the mean is
        wanted; ``ggn-mc`` and ``ggn-topk``): the same draws, each sampled signal scaled by
        ``1/√K`` and ``ggn-topk``'s shared signals as they are, so the sum is the mean of the
        group sums (:func:`normflat.engine.losses.pool_signals`)."""
        return not self.group_estimates and self.estimator in ("ggn-mc", "ggn-topk") and self.groups > 1

    @property
    def sum_groups(self) -> int:
        """Sums per layer of a backend that pools (:attr:`pooled`); else :attr:`state_groups`."""
        if self.pooled:
            return 1
        return self.state_groups

    @property
    def loss_name(self) -> str:
        """Name recorded in reports: the built-in name or the callable's name."""
        if isinstance(self.loss, str):
            return self.loss
        return getattr(self.loss, "__name__", type(self.loss).__name__)

    @property
    def stochastic(self) -> bool:
        """Whether the estimator draws random probes or labels."""
        return self.estimator in ("ggn-mc", "ggn-topk", "hutchinson")

    @property
    def groups(self) -> int:
        """Number ``K`` of independent group estimates (1 for the deterministic estimators).

        Probe or draw ``j`` belongs to group ``j mod K``; with ``K >= 2`` the report
        carries standard errors from the spread of the group means.
        """
        if not self.stochastic or self.samples is None or self.samples < 2:
            return 1
        return min(self.samples, TOPK_MAX_GROUPS if self.estimator == "ggn-topk" else MAX_GROUPS)

    @property
    def shared_group(self) -> bool:
        """Whether the sums hold one more group, shared by all ``K`` (``ggn-topk``'s exact part).

        The estimate of group ``k`` is then ``shared + sampled_k`` (method §6.2): the
        exact top-class curvature is computed once, not once per group.
        """
        return self.estimator == "ggn-topk"

    @property
    def state_groups(self) -> int:
        """Leading size of every per-layer sum: ``K``, or ``1 + K`` with a shared group."""
        return self.groups + (1 if self.shared_group else 0)

    @property
    def draws(self) -> int:
        """Class draws per sample (per token of token logits) the estimator consumes."""
        if self.estimator in ("ggn-mc", "ggn-topk"):
            assert self.samples is not None
            return self.samples
        return 0

    @property
    def per_sequence(self) -> bool:
        """Whether the signals of token logits span whole sequences (method §6.3).

        ``sequence_signals`` if given, else ``True`` for the stochastic ``ggn-mc`` and
        ``ggn-topk`` and ``False`` for the exact ``ggn`` (whose signals are exact per token;
        random signs would make it stochastic). Irrelevant for ``(n, C)`` logits.
        """
        if self.estimator not in ("ggn-mc", "ggn-topk"):
            return False
        return True if self.sequence_signals is None else bool(self.sequence_signals)

    def sequence_layout(self, tokens: int | None) -> bool:
        """Whether logits of ``tokens`` tokens take per-sequence signals (method §6.3).

        The one predicate every backend and the engine's signal functions share: ``(n, C)``
        logits (``tokens`` ``None``) never do; token logits do under :attr:`per_sequence`
        (the stochastic estimators unless ``sequence_signals=False``).
        """
        return tokens is not None and self.per_sequence

    @property
    def sign_draws(self) -> int:
        """Uniforms per token that give the random signs of :attr:`per_sequence` ``ggn-topk``.

        ``K · (k + ⌈S/K⌉)``: one per sampled group and member, ``k`` the unclipped
        ``top_classes`` so that the layout does not depend on the number of classes. ``ggn-mc``
        needs none: its per-token signals ``e_ỹ − p`` already have mean zero.
        """
        if not self.per_sequence or self.estimator != "ggn-topk":
            return 0
        assert self.samples is not None and self.top_classes is not None
        return self.groups * (self.top_classes + -(-self.samples // self.groups))

    def uniform_columns(self, tokens: int | None = None) -> int:
        """Uniforms per sample a GGN estimator consumes: :attr:`draws` for ``(n, C)`` logits;
        ``T · (draws + sign_draws)`` for token logits of ``T`` tokens, token ``t`` taking
        columns ``t·D .. (t+1)·D − 1`` (``D = draws + sign_draws``; the class draws first)."""
        if tokens is None:
            return self.draws
        return int(tokens) * (self.draws + self.sign_draws)

    def signals_per_group(self, num_classes: int) -> int:
        """``M``: signals per sum group (per token) of the ``(K', M)`` layout, padding included.

        ``ggn``: ``C − 1``; ``ggn-mc``: ``⌈S/K⌉``; ``ggn-topk``: ``max(min(k, C), ⌈S/K⌉)``
        (group 0 holds the ``min(k, C)`` exact signals, groups ``1..K`` the draws; shorter
        groups are padded with zero signals, :func:`normflat.engine.losses.signal_slots`, which
        the backends do not back-propagate, :func:`normflat.engine.losses.padding_signals`).
        """
        if self.estimator == "ggn":
            return max(num_classes - 1, 1)
        if self.estimator == "ggn-mc":
            assert self.samples is not None
            return -(-self.samples // self.groups)
        if self.estimator == "ggn-topk":
            assert self.samples is not None and self.top_classes is not None
            return max(min(self.top_classes, num_classes), -(-self.samples // self.groups))
        raise ValueError(f"estimator {self.estimator!r} back-propagates no output signals")

    def token_signals_per_group(self, num_classes: int, tokens: int) -> int:
        """Back-propagated signals per sum group and sequence of token logits (padding included).

        Per token (:attr:`per_sequence` false): ``M · T``, each signal at one token. Per
        sequence: ``ggn-mc``: ``⌈S/K⌉``; ``ggn-topk``: ``min(k, C) + ⌈S/K⌉`` in each sampled
        group (the signed top-class signals, then the signed draws), and the shared group 0
        holds zeros (:func:`normflat.engine.losses.token_signals`).
        """
        if not self.per_sequence:
            return self.signals_per_group(num_classes) * int(tokens)
        assert self.samples is not None
        draws = -(-self.samples // self.groups)
        if self.estimator == "ggn-topk":
            assert self.top_classes is not None
            return min(self.top_classes, num_classes) + draws
        return draws


def check_flags(backend_options: dict[str, Any], names: tuple[str, ...] = ("fast", "force")) -> None:
    """Refuse a backend option among ``names`` that is not ``True`` or ``False`` (the same message in
    every framework: ``fast="no"`` would otherwise read as true).

    Raises:
        TypeError: Naming the option and the value.
    """
    for name in names:
        if name in backend_options and not isinstance(backend_options[name], bool):
            raise TypeError(f"{name} must be True or False, got {backend_options[name]!r}.")


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")


def validate_options(
    *,
    loss: Any = "nsce",
    estimator: str = "auto",
    samples: int | None = None,
    seed: int = 0,
    top_classes: int | None = None,
    max_batches: int | None = None,
    progress: bool = True,
    on_unsupported: str = "warn",
    temperature: float = 1.0,
    ignore_index: int = -100,
    output: Any = None,
    shift_labels: bool | None = None,
    sequence_signals: bool | None = None,
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
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(
            f"Unknown estimator {estimator!r}; choose one of {', '.join(map(repr, ESTIMATORS))}."
        )
    if callable(loss) and estimator in GGN_ESTIMATORS:
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
    _positive_int("samples", samples, allow_none=True)
    if samples is not None and estimator not in DEFAULT_SAMPLES and estimator != "auto":
        raise ValueError(
            f"samples={samples} has no meaning for the deterministic estimator {estimator!r}; "
            "samples sets the probes of 'hutchinson', the label draws of 'ggn-mc' or the draws of "
            "'ggn-topk' (and 'auto'). Drop samples, or choose one of those estimators."
        )
    _positive_int("top_classes", top_classes, allow_none=True)
    if top_classes is not None and estimator not in ("ggn-topk", "auto"):
        raise ValueError(
            f"top_classes={top_classes} has no meaning for estimator={estimator!r}; it sets the classes "
            "whose curvature 'ggn-topk' (and 'auto') takes exactly. Drop it, or pass estimator='ggn-topk'."
        )
    if estimator in ("ggn-topk", "auto"):
        samples = DEFAULT_SAMPLES["ggn-topk"] if samples is None else samples
        top_classes = DEFAULT_TOP_CLASSES if top_classes is None else top_classes
    if estimator in DEFAULT_SAMPLES and samples is None:
        samples = DEFAULT_SAMPLES[estimator]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed}.")
    _positive_int("max_batches", max_batches, allow_none=True)
    if not isinstance(progress, (bool, int)):
        raise TypeError(f"progress must be True or False, got {progress!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}.")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int (the label of tokens the loss skips, -100 by default), "
                        f"got {ignore_index!r}.")
    if ignore_index >= 0:
        raise ValueError(
            f"ignore_index must be negative (a value no class index takes; torch and Hugging Face use "
            f"-100), got {ignore_index}."
        )
    if output is not None and not (isinstance(output, (str, int)) and not isinstance(output, bool)) \
            and not callable(output):
        raise TypeError(
            f"output must be None, a key or attribute name (e.g. 'logits'), a tuple index, or a callable "
            f"output -> logits; got {output!r}."
        )
    if shift_labels is not None and not isinstance(shift_labels, bool):
        raise TypeError(f"shift_labels must be True, False or None (decided by the backend), got {shift_labels!r}.")
    if sequence_signals is not None:
        if not isinstance(sequence_signals, bool):
            raise TypeError(f"sequence_signals must be True, False or None (per sequence for 'ggn-mc' and "
                            f"'ggn-topk', per token for 'ggn'), got {sequence_signals!r}.")
        if sequence_signals and estimator not in ("ggn-mc", "ggn-topk", "auto"):
            raise ValueError(
                f"sequence_signals=True needs a stochastic GGN estimator ('ggn-topk', 'ggn-mc' or 'auto'); "
                f"estimator={estimator!r} " + ("takes its signals exactly, token by token" if estimator == "ggn"
                                               else "back-propagates no output signals")
                + ". Drop sequence_signals, or pass estimator='ggn-topk'.")
        if not sequence_signals and estimator not in GGN_ESTIMATORS:
            raise ValueError(
                f"sequence_signals=False has no meaning for estimator={estimator!r}, which back-propagates "
                "no output signals. Drop sequence_signals.")
    return AnalysisOptions(
        loss=loss,
        estimator=estimator,
        samples=samples,
        seed=seed,
        top_classes=top_classes,
        max_batches=max_batches,
        progress=bool(progress),
        on_unsupported=on_unsupported,
        temperature=float(temperature),
        ignore_index=int(ignore_index),
        output=output,
        shift_labels=shift_labels,
        sequence_signals=sequence_signals,
    )


def resolve_estimator(options: AnalysisOptions, num_classes: int, tokens: int | None = None) -> AnalysisOptions:
    """The concrete estimator of ``estimator="auto"`` for a model with ``num_classes`` classes.

    ``auto`` is the exact ``ggn`` when its ``C − 1`` signals are at most twice the
    ``min(k, C) + S`` signals ``ggn-topk`` back-propagates (the padding of its ``(K', M)``
    layout is not, :func:`normflat.engine.losses.padding_signals`; it also forms ``K'`` sums
    of squares per layer instead of one; with the defaults, ``C <= 25``), and ``ggn-topk``
    otherwise, whose
    cost does not grow with ``C`` and whose standard errors are reported (method §6.2).
    Token logits (``tokens`` given, method §6.3): ``ggn-topk`` with signals per sequence
    (:attr:`~AnalysisOptions.per_sequence`), ``K · (min(k, C) + ⌈S/K⌉)`` back-propagations per
    sequence against the exact ``ggn``'s ``T (C − 1)``; the choice does not depend on ``T``,
    so sequences of any length, on any rank, resolve alike. With ``sequence_signals=False``
    the per-token counts, ``T`` times those of ``(n, C)`` logits, give the rule above.
    Other estimators are returned unchanged.
    """
    if options.estimator != "auto":
        return options
    assert options.samples is not None and options.top_classes is not None
    topk = adopt_estimator(options, "ggn-topk")
    if tokens is not None and topk.per_sequence:
        return topk
    if num_classes - 1 <= 2 * (min(topk.top_classes, num_classes) + topk.samples):
        return adopt_estimator(options, "ggn")
    return topk


def adopt_estimator(options: AnalysisOptions, estimator: str) -> AnalysisOptions:
    """``"auto"`` options resolved to ``estimator`` (``"ggn"`` or ``"ggn-topk"``) without the
    number of classes: what a rank that saw no data takes from the others."""
    if estimator == "ggn":
        return replace(options, estimator="ggn", samples=None, top_classes=None)
    if estimator == "ggn-topk":
        return replace(options, estimator="ggn-topk")
    raise ValueError(f"estimator='auto' resolves to 'ggn' or 'ggn-topk', not {estimator!r}")


def validate_solver_options(tol: Any, max_iter: Any) -> None:
    """Check the solver options before any model work starts (the core checks them again).

    Raises:
        TypeError: If ``max_iter`` is not an int or ``tol`` not a number.
        ValueError: If ``tol`` is not a finite positive number or ``max_iter < 1``.
    """
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"tol must be a positive finite number, got {tol!r}.")
    if not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be a positive finite number (a relative balance tolerance such as 1e-10), "
                         f"got {tol!r}.")
    _positive_int("max_iter", max_iter)


def progress_bar(
    iterable: Iterable[T], *, enabled: bool, desc: str, total: int | None = None
) -> Iterable[T]:
    """Wrap ``iterable`` in a tqdm bar when ``enabled`` (tqdm is a core dependency).

    The bar (when enabled) has ``set_description``, for the estimator that ``"auto"``
    resolves to on the first batch.
    """
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="batch", leave=False)


def limited(iterable: Iterable[T], max_batches: int | None) -> Iterator[T]:
    """Yield at most ``max_batches`` items (without drawing one more from ``iterable``)."""
    if max_batches is None:
        yield from iterable
        return
    if max_batches <= 0:
        return
    for i, item in enumerate(iterable):
        yield item
        if i + 1 >= max_batches:
            return
