"""The one analysis loop every backend runs: setup, batches, reduction, problems.

A backend implements :class:`Session` for one model and one set of options:
what is truly framework-specific (the layers it found, a forward pass, its
autodiff kernels, its collectives). :func:`run` does the rest, the same way for
every framework:

1. the data contract (:mod:`normflat.engine.data`), with one progress bar;
2. in a distributed run, the setup agreement and one status step per batch
   (:mod:`normflat.engine.distributed`);
3. the estimator state (:mod:`normflat.engine.estimators`): the session adds
   each batch's per-layer ``(K, *shape)`` sums;
4. the reduction over ranks, the group estimates and their mean, and the one warning
   for a softmax saturated on every sample (method §7);
5. the model is restored by :meth:`Session.close`, also after an error or a
   ``KeyboardInterrupt``.

:func:`layer_problems` and :func:`hessian_diagonal` turn the result into
``LayerProblem`` objects (:mod:`normflat.engine.problems`) or a dict of
diagonals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from normflat.core.problem import LayerProblem
from normflat.engine import data as data_contract
from normflat.engine import distributed
from normflat.engine import estimators, losses, native
from normflat.engine.data import Batch, DataAdapter
from normflat.engine.distributed import Comm
from normflat.engine.options import AnalysisOptions, adopt_estimator, progress_bar
from normflat.engine.problems import LayerSpec, build_metadata, build_problems, split_diagonals
from normflat.engine.registry import warn_user

__all__ = ["Session", "Result", "run", "layer_problems", "hessian_diagonal"]


class Session(Protocol):
    """One model under analysis, as a backend sees it.

    Attributes:
        framework: ``"torch"``, ``"keras"`` or ``"jax"``.
        framework_version: The framework's version string.
        adapter: The backend's :class:`~normflat.engine.data.DataAdapter`.
        layers: The analyzed weights, in model order (known after construction).
        unsupported: Messages of the layers skipped (``on_unsupported``).
        options: The options in use; a session given ``estimator="auto"`` replaces them
            with :func:`~normflat.engine.options.resolve_estimator`'s on its first batch,
            when the number of classes is known, and sizes its sums with
            ``options.state_groups``.
        saturation: The least :func:`~normflat.engine.losses.softmax_saturation` of the
            batches checked so far (``inf`` before the first): the engine warns when it is
            ``>= 0`` once every check has been read (after the loop in a distributed run, whose
            sessions read their checks in every step; else after the first :meth:`all_finite`).

    A session may also define ``kernel_axes(layer) -> tuple[int, ...]``: the kernel axes of
    one group's array of ``layer`` in the layout it adds in (``()`` for none), with
    :meth:`canonical` accepting the array with those axes of size 1. The estimator state
    then keeps that layer's group sums as kernel sums (:mod:`normflat.engine.estimators`).
    """

    framework: str
    framework_version: str
    adapter: DataAdapter
    layers: list[LayerSpec]
    unsupported: list[str]
    options: AnalysisOptions
    saturation: float

    def signature(self) -> list[Any]:
        """What this rank will compute (layer names, shapes, dtypes), for the setup agreement."""

    def update(self, batch: Batch, state: estimators.SumState) -> int | None:
        """Add one batch's per-layer ``(K', *native shape)`` sums to ``state``.

        The session runs the forward, checks the output with
        :func:`normflat.engine.losses.check_output_shape` / ``check_logit_stats``,
        converts labels with :func:`normflat.engine.data.labels_for`, and draws
        randomness from :mod:`normflat.engine.random` keyed on ``batch.offset``.

        Returns:
            The number of terms the batch adds to the mean loss: the counted tokens
            of token logits (method §6.3), or ``None`` for one term per sample.
        """

    def zeros(self, layer: int) -> Any:
        """``(K', *native shape)`` zeros of layer ``layer`` (a layer the loss never reached)."""

    def all_finite(self, array: Any) -> bool:
        """Whether a native array is finite."""

    def canonical(self, layer: int, array: Any) -> Any:
        """A native-shape array of layer ``layer`` in the canonical ``(out, in/groups, *k)`` layout."""

    def weight(self, layer: int) -> Any:
        """The canonical weight of layer ``layer`` (a detached copy or view)."""

    def metadata(self) -> dict[str, Any]:
        """``dtype``, ``device``, ``chunk_size``, ``memory_budget`` and ``backend`` extras, and
        ``token_logits`` (whether the model returned ``(n, T, C)`` token logits)."""

    def close(self) -> None:
        """Restore everything of the user's model and process that the session touched."""

    def forward_error(self, batch: Batch) -> BaseException | None:
        """The error of the model's own forward on the first rows of ``batch``'s inputs, without
        normflat's recording or gradients, or ``None`` where it runs. Asked only after
        :meth:`update` failed on ``batch`` with an error that normflat did not raise itself
        (:func:`~normflat.engine.data.raised_by_normflat`): where the model fails on those inputs
        too, the driver raises :func:`~normflat.engine.data.model_fails_on_inputs` for that batch,
        as the backends do at the first forward (:func:`~normflat.engine.data.model_failures`)."""


@dataclass
class Result:
    """Per-layer diagonals (canonical) and group estimates, plus the metadata."""

    layers: list[LayerSpec]
    weights: list[Any]
    diags: list[Any]
    samples: list[Any]
    metadata: dict[str, Any]


def _loop(session: Session, data: Any, options: AnalysisOptions, state: estimators.SumState,
          comm: Comm | None) -> tuple[int, int]:
    rank = comm.rank if comm is not None else 0
    try:
        batches, total = data_contract.batches(data, session.adapter, options)
    except Exception as err:  # noqa: BLE001 - in a distributed run, raised on every rank by the first step
        if comm is None:
            raise
        batches, total = _raising(err), None
    shown = progress_bar(batches, enabled=options.progress and rank == 0, desc=f"normflat {options.estimator}",
                         total=total)
    bar = iter(shown)
    named = options.estimator
    examples = count = terms = 0
    exhausted = False
    while True:
        error: BaseException | None = None
        active = False
        try:
            if not exhausted:
                batch = next(bar)
                active = True
                # A later batch that the model does not take gets the first forward's error.
                with data_contract.model_failures(session.framework, batch, session.forward_error):
                    added = session.update(batch, state)
                used = getattr(session, "options", options).estimator
                if used != named and hasattr(shown, "set_description"):
                    named = used  # "auto" resolved on the first batch
                    shown.set_description(f"normflat {named}")
                examples += batch.n
                terms += batch.n if added is None else int(added)
                count += 1
        except StopIteration:
            exhausted = True
        except data_contract.EmptyDataError:
            if comm is None:
                raise
            exhausted = True  # an empty shard is not an error on its own: the ranks decide together
        except Exception as err:  # noqa: BLE001 - propagated to every rank below
            if comm is None:
                raise
            error = err
        if comm is None:
            if exhausted:
                break
        elif not distributed.step(comm, active, error, f"on batch {count}"):
            break
    return examples, count, terms


def _raising(error: BaseException):
    """An iterator whose first ``next`` raises ``error`` (a data error on this rank only)."""
    raise error
    yield  # noqa: unreachable - makes this a generator


def run(make_session: Callable[[], Session], data: Any, options: AnalysisOptions,
        comm: Comm | None = None, with_groups: bool = True) -> Result:
    """Open a session, run the analysis loop over ``data``, always close the session.

    Args:
        make_session: Builds the backend's session (discovers the layers, checks
            the backend options). In a distributed run its failure on one rank is
            raised on every rank.
        data: The user's data.
        options: The validated options.
        comm: The collectives of a distributed run, or ``None``.
        with_groups: Whether to keep the group estimates (for standard errors);
            ``hessian_diagonal`` needs only their mean.

    Raises:
        ValueError, TypeError: From the data contract, the session's checks, or a
            non-finite diagonal; in a distributed run on every rank.
    """
    session: Session | None = None
    error: BaseException | None = None
    try:
        session = make_session()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        if comm is None:
            raise
        error = err
    try:
        if comm is not None:
            signature = None if session is None else session.signature() + [repr(options)]
            distributed.agree(comm, error, signature)
        assert session is not None
        # Where the group estimates are wanted, a layer's groups may be kept as kernel sums
        # (the measures need no more, method §3): the session says which axes those are.
        state = estimators.init(len(session.layers), options,
                                kernel_axes=getattr(session, "kernel_axes", None) if with_groups else None,
                                resolved=lambda: getattr(session, "options", options))
        examples, count, terms = _loop(session, data, options, state, comm)
        saturation: float | None = None
        extra: dict[str, Any] = {}
        if comm is not None:
            if options.estimator == "auto":
                _agree_on_estimator(comm, session)
            for i, sums in enumerate(state.sums):
                if sums is None:  # a rank that saw no batch: zeros, in the form the others hold
                    state.add(i, session.zeros(i), owned=True)
            for i in sorted(state.exact):
                # An exact layer keeps only its shared sum (1, ...) (SumState.add_exact), a rank that
                # saw no batch or took another path has all of them: the same shape on every rank.
                state.expand_exact(i, session.zeros(i))
            state.sums = comm.sum_arrays(state.sums)
            compacted = [i for i in range(len(state.sums)) if state.compacted(i)]
            if compacted:
                for i, mean in zip(compacted, comm.sum_arrays([state.means[i] for i in compacted])):
                    state.means[i] = mean
            # A distributed session reads its checks in every step: its saturation is complete.
            gathered = comm.gather((examples, session.saturation))
            per_rank = [e for e, _ in gathered]
            saturation = min(s for _, s in gathered)
            examples, count, terms = comm.sum_ints([examples, count, terms])
            extra = {"world_size": comm.size, "examples_per_rank": per_rank}
            if examples == 0:
                raise ValueError("The data is empty on every rank: no rank yielded a sample.")
        if terms == 0:
            raise ValueError(
                f"No token of the data is counted by the loss: every token label equals ignore_index="
                f"{options.ignore_index}. Pass labels for at least one token (or the right ignore_index)."
            )
        # "auto" is resolved by the session once it has seen the classes (the same on every rank).
        options = getattr(session, "options", options)
        if options.estimator == "auto":
            raise RuntimeError(f"the {session.framework} session did not resolve estimator='auto'")
        # The mean loss averages its terms: samples, or the counted tokens of token logits.
        results = estimators.finalize(state, options, terms, session.zeros, session.all_finite,
                                      [layer.name for layer in session.layers], with_groups=with_groups)
        diags = [session.canonical(i, d) for i, (d, _) in enumerate(results)]
        samples = []
        for i, (_, groups) in enumerate(results):
            samples.append(None if groups is None else _canonical_groups(session, i, groups))
        weights = [session.weight(i) for i in range(len(session.layers))]
        meta = session.metadata()
        backend = dict(meta.pop("backend", {}) or {})
        if "examples_per_rank" in extra:
            backend["examples_per_rank"] = extra["examples_per_rank"]
        metadata = build_metadata(
            session.framework, session.framework_version, options, examples=examples, batches=count,
            dtype=meta.pop("dtype"), device=meta.pop("device"), unsupported=session.unsupported,
            world_size=extra.get("world_size", 1), chunk_size=meta.pop("chunk_size", None),
            memory_budget=meta.pop("memory_budget", None), backend={**backend, **meta},
            loss_terms=terms, parameters=getattr(session, "parameters", None),
            token_logits=bool(meta.pop("token_logits", False)),
        )
        # One process reads the last checks in finalize (Session.all_finite): only now complete.
        saturated = losses.saturation_warning(session.saturation if saturation is None else saturation, options)
        if saturated is not None:
            warn_user(saturated)
        return Result(list(session.layers), weights, diags, samples, metadata)
    finally:
        if session is not None:
            session.close()


def _agree_on_estimator(comm: Comm, session: Session) -> None:
    """A rank that saw no batch has not resolved ``"auto"``: it takes the others' estimator
    (every rank analyzes the same model, so the resolved ones agree), so that its zero sums
    have the same shape."""
    used = comm.gather(getattr(session, "options", None) and session.options.estimator)
    chosen = sorted({name for name in used if name not in ("auto", None)})
    if len(chosen) > 1:
        raise RuntimeError(f"the ranks resolved estimator='auto' differently: {used}")
    if chosen and session.options.estimator == "auto":
        session.options = adopt_estimator(session.options, chosen[0])


def _canonical_groups(session: Session, layer: int, groups: Any) -> Any:
    """``(K, *canonical)`` group estimates: ``groups`` itself when it is one array and the
    layer's canonical layout is its native one (no copy of ``K`` arrays), else the canonical
    groups stacked."""
    if isinstance(groups, (list, tuple)):
        return native.stack([session.canonical(layer, g) for g in groups])
    views = [groups[k] for k in range(int(groups.shape[0]))]
    canonical = [session.canonical(layer, v) for v in views]
    if all(c is v for c, v in zip(canonical, views)):
        return groups
    return native.stack(canonical)


def layer_problems(make_session: Callable[[], Session], data: Any, options: AnalysisOptions,
                   comm: Comm | None = None) -> tuple[list[LayerProblem], dict]:
    """The backend contract of ``normflat.backends``: problems and report metadata."""
    result = run(make_session, data, options, comm)
    return build_problems(result.layers, result.weights, result.diags, result.samples), result.metadata


def hessian_diagonal(make_session: Callable[[], Session], data: Any, options: AnalysisOptions,
                     comm: Comm | None = None) -> dict[str, Any]:
    """``{layer name: canonical diagonal}`` in model order."""
    result = run(make_session, data, options, comm, with_groups=False)
    return split_diagonals(result.layers, result.diags)
