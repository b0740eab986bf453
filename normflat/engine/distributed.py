"""One failure-agreement and reduction protocol over a small :class:`Comm` interface.

``torch.distributed``, ``tf.distribute`` (multi-worker) and JAX multi-process
each implement :class:`Comm`; the protocol itself is written once:

1. **Setup agreement** (:func:`agree`): every rank reports whether its setup
   failed and a *signature* of what it will compute (layers, shapes, dtypes,
   options); any failure or mismatch raises on every rank before any reduction.
2. **Batch steps** (:func:`step`): after every batch each rank reports whether it
   is still active and whether it failed, so a failure on one rank raises on all
   of them and ranks with fewer batches keep answering until all are done.
3. **Reduction**: per-layer sums and sample counts are summed in one fixed order
   (:meth:`Comm.sum_arrays`), so every rank returns the identical result.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

__all__ = ["Comm", "agree", "step", "DistributedFailure"]


class Comm(Protocol):
    """The collectives a framework supplies for a distributed analysis."""

    rank: int
    size: int

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise sum over ranks of a short list of ints."""

    def gather(self, obj: Any) -> list[Any]:
        """All-gather a small picklable object; position ``r`` holds rank ``r``'s."""

    def sum_arrays(self, arrays: list[Any]) -> list[Any]:
        """Element-wise sums over ranks of native arrays (same shapes on every rank)."""


class DistributedFailure(RuntimeError):
    """Raised on the ranks that did not fail themselves when another rank failed."""


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {str(error).rstrip('.')}"


def _fail(comm: Comm, failed: list[tuple[int, str]], phase: str) -> None:
    detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
    raise DistributedFailure(
        f"normflat stopped on rank {comm.rank} because {len(failed)} of {comm.size} ranks failed "
        f"{phase} ({detail}). Fix the cause on the failing rank; every rank raises so that none waits "
        "forever."
    )


def agree(comm: Comm, error: BaseException | None, signature: Any, phase: str = "while setting up") -> None:
    """Raise on every rank if any rank failed or the ranks' ``signature`` differ.

    A failing rank re-raises its own error; the others raise :class:`DistributedFailure`
    naming it.
    """
    gathered = comm.gather((_describe(error), signature))
    failed = [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]
    if failed:
        if error is not None:
            raise error
        _fail(comm, failed, phase)
    first = gathered[0][1]
    for r, (_, sig) in enumerate(gathered):
        if sig != first:
            diff = next((f"{a!r} on rank 0 vs {b!r} on rank {r}" for a, b in zip(first, sig) if a != b),
                        f"{len(first)} entries on rank 0 vs {len(sig)} on rank {r}")
            raise ValueError(
                "The ranks do not analyze the same model or options (layers, shapes, dtypes, estimator, "
                f"loss): {diff}. Every rank must pass the same model architecture and options and only "
                "its own shard of the data (or pass distributed=False to analyze each rank's data alone)."
            )


def step(comm: Comm, active: bool, error: BaseException | None, phase: str) -> bool:
    """One synchronization after a batch: raise everywhere if any rank failed; whether any is active."""
    active_ranks, failed_ranks = comm.sum_ints([int(active), int(error is not None)])
    if failed_ranks:
        messages = comm.gather(_describe(error))
        if error is not None:
            raise error
        _fail(comm, [(r, m) for r, m in enumerate(messages) if m is not None], phase)
    return bool(active_ranks)
