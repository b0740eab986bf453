"""Public entry points: :func:`analyze` and :func:`hessian_diagonal`."""

from __future__ import annotations

from typing import Any

from normflat.backends import backend_for
from normflat.core.measures import DEFAULT_MAX_ITER, DEFAULT_TOL, analyze_problems
from normflat.engine.options import validate_options, validate_solver_options
from normflat.core.problem import LayerProblem
from normflat.core.report import Report

__all__ = ["analyze", "hessian_diagonal", "measures"]


def analyze(
    model: Any,
    data: Any = None,
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
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    **backend_options: Any,
) -> Report:
    """Normalized sharpness of a model (or of given layer problems), per layer and in total.

    Args:
        model: A torch ``nn.Module``, a Keras model, an equinox / flax nnx module, a
            ``(flax linen module, variables)`` or ``(apply_fn, params)`` pair; or a
            list of :class:`LayerProblem` (framework-free path, ``data`` unused).
        data: Training data: a DataLoader / ``tf.data.Dataset`` / iterable of
            ``(x, y)`` batches, or one ``(x, y)`` pair.
        loss: ``"nsce"`` (normalized softmax cross-entropy, method §7), ``"ce"``, or a
            callable ``(logits, y) -> mean loss``.
        estimator: Hessian-diagonal estimator (method §6; their meaning in every
            framework: docs/semantics.md): ``"auto"`` (the default: the exact
            ``"ggn"`` up to 25 classes, ``"ggn-topk"`` above, with the defaults of
            ``samples`` and ``top_classes``), ``"ggn"``, ``"ggn-topk"``, ``"ggn-mc"``,
            ``"hutchinson"`` or ``"exact"``.
        samples: Probes (hutchinson, default 100), label draws per input (ggn-mc,
            default 1) or draws of the classes outside the top ones (ggn-topk and
            auto, default 10).
        seed: Seed of the stochastic estimators.
        top_classes: Classes of each input (or token) whose curvature ``ggn-topk``
            (and ``auto``) takes exactly, the most probable ones (default 2).
        max_batches: Use at most this many batches.
        progress: Show a progress bar over batches.
        on_unsupported: What to do with layers that have parameters but are not
            recognised: ``"error"``, ``"warn"`` or ``"skip"``.
        temperature: ``τ`` of the normalized softmax cross-entropy.
        ignore_index: Token label not counted by a sequence loss (logits
            ``(batch, tokens, classes)`` with labels ``(batch, tokens)``, method §6.3).
        output: What to take from a model output that is not an array: ``None``
            (``.logits`` of a Hugging Face output, ``["logits"]`` of a dict, the first
            entry of a tuple), a key/attribute name, an index, or a callable.
        shift_labels: Whether token logits at ``t`` predict the label at ``t + 1``
            (``None``: yes for Hugging Face causal language models, no otherwise).
        sequence_signals: Token logits: whether each back-propagated signal spans a whole
            sequence, the tokens' signals summed with independent random signs (one
            back-propagation per signal and sequence instead of one per signal and token;
            unbiased, its spread in the standard errors), or one token. ``None``: per
            sequence for ``"ggn-topk"``, ``"ggn-mc"`` and ``"auto"``'s ``"ggn-topk"``, per
            token for the exact ``"ggn"`` (method §6.3).
        tol: Relative balance tolerance of the per-layer solver.
        max_iter: Maximum solver sweeps per layer.
        **backend_options: Options of the model's backend (see its guide).

    Returns:
        A :class:`Report` with the totals, one entry per weight tensor and metadata.

    Raises:
        TypeError: If the model type is not recognised or an option has the wrong type.
        ValueError: For invalid options or data, with the cause and the fix.
    """
    if isinstance(model, (list, tuple)) and (
        len(model) == 0 or any(isinstance(p, LayerProblem) for p in model)
    ):
        if data is not None or backend_options:
            raise TypeError(
                "analyze(list of LayerProblem) takes no data or backend options; the layer "
                "problems already hold the Hessian diagonals."
            )
        return analyze_problems(model, metadata={"framework": None}, tol=tol, max_iter=max_iter)
    validate_solver_options(tol, max_iter)
    options = validate_options(
        loss=loss, estimator=estimator, samples=samples, seed=seed, top_classes=top_classes,
        max_batches=max_batches,
        progress=progress, on_unsupported=on_unsupported, temperature=temperature,
        ignore_index=ignore_index, output=output, shift_labels=shift_labels,
        sequence_signals=sequence_signals,
    )
    name, backend = backend_for(model)
    if data is None:
        raise ValueError(
            "analyze(model, data) needs training data: the Hessian diagonal is that of the "
            "mean training loss over the data you pass."
        )
    # The engine's metadata (normflat.engine.problems.METADATA_KEYS) already holds these
    # keys for the built-in backends; a third-party backend may return fewer.
    problems, metadata = backend.layer_problems(model, data, options, **backend_options)
    meta = {
        "framework": name,
        "loss": options.loss_name,
        "estimator": options.estimator,
        "samples": options.samples,
        "top_classes": options.top_classes,
        "seed": options.seed if options.samples is not None else None,
        "temperature": options.temperature if options.loss == "nsce" else None,
    }
    meta.update(metadata)
    return analyze_problems(problems, metadata=meta, tol=tol, max_iter=max_iter)


def hessian_diagonal(
    model: Any,
    data: Any,
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
    **backend_options: Any,
) -> dict[str, Any]:
    """Hessian (or GGN) diagonal of the mean training loss for every recognised layer.

    Takes the same model, data and options as :func:`analyze`. Only the mean of a
    stochastic estimator's group estimates is returned, so the PyTorch backend keeps one
    sum for the sampled groups instead of ``K`` (method §6.2, memory of the groups).

    Returns:
        ``{layer name: array}`` in the framework's array type, canonical
        ``(out, in, *kernel)`` layout, model order.
    """
    options = validate_options(
        loss=loss, estimator=estimator, samples=samples, seed=seed, top_classes=top_classes,
        max_batches=max_batches,
        progress=progress, on_unsupported=on_unsupported, temperature=temperature,
        ignore_index=ignore_index, output=output, shift_labels=shift_labels,
        sequence_signals=sequence_signals,
    )
    _, backend = backend_for(model)
    return backend.hessian_diagonal(model, data, options, **backend_options)


def measures(
    model: Any,
    data: Any,
    names: Any = None,
    *,
    report: Any = None,
    settings: Any = None,
    loss: Any = "nsce",
    estimator: str = "auto",
    samples: int | None = None,
    seed: int = 0,
    max_batches: int | None = None,
    progress: bool = True,
    on_unsupported: str = "warn",
    temperature: float = 1.0,
    ignore_index: int = -100,
    output: Any = None,
    shift_labels: bool | None = None,
    sequence_signals: bool | None = None,
    backend_options: dict[str, Any] | None = None,
    **setting_overrides: Any,
) -> Any:
    """The rival generalization measures of a trained model and the PAC-Bayes bound (method §10).

    Computes, on the same model and training data as :func:`analyze`: the worst-case
    and average adaptive sharpness, the magnitude-aware PAC-Bayes sharpness, the
    Fisher–Rao norm, the path norm, the log products of spectral and Frobenius
    norms, and the PAC-Bayes bound (0-1 loss and bounded surrogate) of normalized
    sharpness's optimal variances.

    Args:
        model: A model of any supported framework (as for :func:`analyze`).
        data: The training data, re-iterable (a list of batches, a DataLoader, a
            ``tf.data.Dataset`` or an ``(x, y)`` pair): the measures pass over it many times.
        names: The measures to compute (names of
            :data:`normflat.engine.rivals.RIVAL_MEASURES`); ``None``: all.
        report: For the bound: ``analyze(model, data)`` of the same model; computed
            here (with ``estimator``, ``samples``) when ``None`` and the bound is asked for.
        settings: A :class:`~normflat.engine.rivals.MeasureSettings`; its fields can
            also be given one by one as keyword arguments (``rho=0.05``).
        loss: ``"nsce"`` (normalized logits, method §7: the logit normalization of
            Andriushchenko et al.) or ``"ce"``. Custom callables are refused: the
            measures need every prediction's loss.
        estimator, samples: Hessian-diagonal estimator of the analysis behind the bound.
        seed: Seed of normflat's own generators (the global RNG is not used).
        max_batches, progress, on_unsupported, temperature, ignore_index, output,
            shift_labels, sequence_signals: As for :func:`analyze`.
        backend_options: Options of the model's backend, as for :func:`analyze`.
        **setting_overrides: Fields of :class:`~normflat.engine.rivals.MeasureSettings`.

    Returns:
        A :class:`~normflat.engine.rivals.MeasuresReport`; its values also read as
        attributes (``result.path_norm``).

    Raises:
        ValueError: For unknown measures or settings, a custom loss, or bad data.
        TypeError: For a one-shot iterator as data, or an unknown keyword.
        UnsupportedMeasureError: For a measure the model does not admit (e.g. the path
            norm of a transformer), naming the layer.
    """
    from normflat.engine import rivals
    from normflat.engine.perturbation import check_rival_options, require_reiterable

    chosen = rivals.validate_measure_names(names)
    resolved = rivals.MeasureSettings.from_overrides(settings, setting_overrides)
    # The options of the analysis behind the bound, which are also those of the measures.
    common = dict(loss=loss, estimator=estimator, samples=samples, seed=seed, max_batches=max_batches,
                  progress=progress, on_unsupported=on_unsupported, temperature=temperature,
                  ignore_index=ignore_index, output=output, shift_labels=shift_labels,
                  sequence_signals=sequence_signals)
    options = validate_options(**common)
    check_rival_options(options)
    if data is None:
        raise ValueError("measures(model, data) needs the training data the measures are computed on.")
    require_reiterable(data)
    name, backend = backend_for(model)
    if not hasattr(backend, "perturbation_model"):
        raise TypeError(f"The {name} backend does not provide normflat.measures (no perturbation_model).")
    layers = None
    if any(n in rivals.BOUND_MEASURES for n in chosen):
        if report is None:
            report = analyze(model, data, **common, **(backend_options or {}))
        layers = report.layers
    perturbed = backend.perturbation_model(model, data, options, **(backend_options or {}))
    try:
        return rivals.compute_measures(
            perturbed, chosen, resolved, seed=seed, layers=layers, progress=progress,
            metadata={"framework": name, "loss": options.loss_name,
                      "temperature": options.temperature if options.loss == "nsce" else None,
                      "bound_estimator": None if layers is None else report.metadata.get("estimator")},
        )
    finally:
        perturbed.close()
