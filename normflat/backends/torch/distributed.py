"""``torch.distributed`` collectives behind the engine's :class:`~normflat.engine.distributed.Comm`.

The protocol (setup agreement, one status step per batch, the reduction) is the
engine's (:mod:`normflat.engine.distributed`); this module only supplies the
three collectives over a process group. Every collective is entered by every rank
in the same order; a rank that dies or hangs is caught by the process group's own
timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["TorchComm", "create"]


class TorchComm:
    """The all-reduces and gathers of a data-parallel run over a ``torch.distributed`` group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # NCCL reduces CUDA tensors only, gloo and MPI CPU tensors; a mixed backend
        # ("cpu:gloo,cuda:nccl") takes tensors where they are.
        if backend == "nccl":
            self.device: torch.device | None = torch.device("cuda", torch.cuda.current_device())
        elif backend in ("gloo", "mpi"):
            self.device = torch.device("cpu")
        else:
            self.device = None

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        moved = t if self.device is None else t.to(self.device)
        if moved is t:
            moved = t.clone()
        self.dist.all_reduce(moved, op=self.dist.ReduceOp.SUM, group=self.group)
        return moved.to(t.device)

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        flags = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device or "cpu")
        return [int(v) for v in self._sum(flags).tolist()]

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum_arrays(self, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-reduced copies of ``arrays`` (one collective per dtype, in a fixed order)."""
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype in sorted({a.dtype for a in arrays}, key=str):
            idx = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            flat = self._sum(torch.cat([arrays[i].reshape(-1) for i in idx]))
            start = 0
            for i in idx:
                a = arrays[i]
                out[i] = flat[start:start + a.numel()].reshape(a.shape).to(a.device)
                start += a.numel()
        return out  # type: ignore[return-value]


def create(distributed: Any) -> TorchComm | None:
    """The collectives for the ``distributed`` backend option, or ``None`` for a local run.

    Args:
        distributed: ``None`` (the default group when one is initialized), ``True``
            (require it), ``False`` (local) or a ``ProcessGroup``.

    Raises:
        TypeError: For another value.
        ValueError: For ``True`` without an initialized group.
    """
    if distributed is False:
        return None
    import torch.distributed as dist

    if distributed is not None and distributed is not True:
        if not (dist.is_available() and isinstance(distributed, dist.ProcessGroup)):
            raise TypeError(
                f"distributed must be None (automatic), True, False or a torch.distributed "
                f"ProcessGroup, got {type(distributed).__name__}."
            )
        return TorchComm(distributed)
    if dist.is_available() and dist.is_initialized():
        return TorchComm()
    if distributed is True:
        raise ValueError(
            "distributed=True but torch.distributed is not initialized; launch with torchrun and "
            "call torch.distributed.init_process_group() first, or pass distributed=False."
        )
    return None
