"""JAX's collectives for a distributed analysis: local device meshes and multi-process runs.

Two levels, as in JAX itself:

* **devices of one process**: each batch piece is sharded over a 1-D
  :class:`jax.sharding.Mesh` with axis ``"data"`` (:func:`mesh`); the kernels run
  under ``shard_map`` and the per-device partial sums are added on the host;
* **processes** (after :func:`jax.distributed.initialize`): :class:`ProcessComm`
  implements the engine's :class:`~normflat.engine.distributed.Comm` with
  ``process_allgather``, and the engine's driver runs the failure agreement,
  the per-batch steps and the reduction (:mod:`normflat.engine.distributed`).
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import jax
import numpy as np

from normflat.backends.jax.compat import process_allgather

__all__ = ["ProcessComm", "mesh", "multi_process"]


def multi_process(settings: dict) -> bool:
    """Whether this analysis combines the data of several ``jax.distributed`` processes."""
    return settings["distributed"] is not False and jax.process_count() > 1


def mesh(settings: dict):
    """The 1-D ``("data",)`` mesh of local devices to shard batches over, or None for one device."""
    if settings["distributed"] is False:
        return None
    local = jax.local_devices()
    devs = settings["devices"]
    if devs is None:
        devs = local
    elif isinstance(devs, int):
        if devs > len(local):
            raise ValueError(f"devices={devs} but this process has {len(local)} local device(s): {local}.")
        devs = local[:devs]
    else:
        foreign = [d for d in devs if d not in local]
        if foreign:
            raise ValueError(
                f"devices {foreign} are not local devices of this process; pass local devices only. Across "
                "processes (after jax.distributed.initialize) each process passes its own data and the results "
                "are combined automatically."
            )
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices lists a device twice: {devs}.")
    if len(devs) < 2:
        return None
    return jax.sharding.Mesh(np.asarray(devs, dtype=object), ("data",))


class ProcessComm:
    """:class:`~normflat.engine.distributed.Comm` over the processes of ``jax.distributed``.

    Every call is one (or two) ``process_allgather`` of host arrays, made by every
    process in the same order (the engine's protocol guarantees it).
    """

    def __init__(self) -> None:
        self.rank = int(jax.process_index())
        self.size = int(jax.process_count())

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        table = np.asarray(process_allgather(np.asarray(list(values), dtype=np.int32)))
        return [int(v) for v in table.reshape(self.size, -1).sum(axis=0)]

    def gather(self, obj: Any) -> list[Any]:
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        # process_allgather needs equal shapes: exchange the lengths first, then padded bytes.
        lengths = np.asarray(process_allgather(np.asarray([payload.size], np.int32))).reshape(-1)
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[: payload.size] = payload
        table = np.asarray(process_allgather(padded)).reshape(self.size, -1)
        return [pickle.loads(table[r, : int(lengths[r])].tobytes()) for r in range(self.size)]

    def sum_arrays(self, arrays: list[Any]) -> list[Any]:
        import jax.numpy as jnp

        shapes = self.gather([(tuple(np.shape(a)), str(getattr(a, "dtype", ""))) for a in arrays])
        empty = [r for r, s in enumerate(shapes) if not s]
        if empty and len(empty) < self.size:
            raise ValueError(
                f"Process(es) {empty} received no (x, y) batch; in a multi-process analysis every process "
                "needs at least one batch of its data shard (or pass distributed=False).")
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"The processes computed sums of different shapes: {shapes}.")
        if not arrays:
            return []
        gathered = process_allgather([np.asarray(a) for a in arrays])  # GroupSums stack themselves
        # Summed on the host in rank order: every process gets the identical result.
        return [jnp.asarray(np.asarray(g).sum(axis=0)) for g in gathered]
