"""Every touch of a private or internal PyTorch API, in one place.

Each entry says why the public API does not suffice, so that a torch upgrade
that breaks one of them breaks it here, visibly, and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "NORM_BASE",
    "tensor_version",
    "graph_node_name",
    "graph_leaf",
    "is_fsdp",
    "is_dtensor",
]

#: BatchNorm/InstanceNorm share this private base class; registering it ignores all of
#: them (and user subclasses) at once, where the public classes would need a list that
#: misses new variants (LazyBatchNorm, SyncBatchNorm).
NORM_BASE: type = nn.modules.batchnorm._NormBase


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t``.

    The fast GGN path keeps a layer's input from the forward to form the squares
    after the backward; an in-place op on that input in between (``x += ...`` in a
    residual block) would make the squares silently wrong. ``Tensor._version`` is
    the only way to detect it (autograd itself uses it for the same check).
    """
    return int(t._version)


def graph_node_name(fn: Any) -> str:
    """Name of an autograd graph node (``AddmmBackward0``), to decide batched backward.

    ``Node.name()`` is documented but the node classes are not part of the public
    API; it is used to check that every backward op of the graph has a vmap
    batching rule (``is_grads_batched=True`` otherwise falls back to a slow loop).
    """
    return str(fn.name())


def graph_leaf(fn: Any) -> Any:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into (else ``None``).

    Walking ``grad_fn.next_functions`` to the ``AccumulateGrad`` nodes is the only
    way to count how many times a weight enters the graph (a weight used twice, or
    functionally, needs the generic GGN path).
    """
    return getattr(fn, "variable", None)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP wrapper (checked by class name).

    Importing ``torch.distributed.fsdp`` just to check is slow and can fail on
    builds without distributed support.
    """
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(module).__mro__)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a sharded parameter of ``fully_shard``), by class name."""
    return type(t).__name__ == "DTensor"
