"""``tf.distribute``: the strategy of an analysis, its local replicas and the cross-worker ``Comm``.

* **Local replicas** (``MirroredStrategy``, or the GPUs of one worker): each
  batch's chunks are dealt to this worker's replicas and computed in parallel
  with ``strategy.run`` (:class:`Replicas`); the per-replica sums are added.
* **Workers** (``MultiWorkerMirroredStrategy`` with several workers): every
  worker passes its own shard of the data and runs the engine's protocol
  (:mod:`normflat.engine.distributed`) over :class:`StrategyComm`, whose
  collectives are ``strategy.reduce(SUM)`` over all replicas of all workers.

The result equals the single-device one up to the order of floating-point additions.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from normflat.backends.keras import compat

__all__ = ["detect_strategy", "Replicas", "StrategyComm", "worker_count", "worker_rank"]


def detect_strategy(model: Any, distributed: bool | None) -> Any | None:
    """The strategy to analyze ``model`` with, or ``None`` for a plain single-device run.

    Raises:
        ValueError: ``distributed=True`` without a strategy.
        RuntimeError: Called inside ``strategy.run`` (a replica context).
        NotImplementedError: Another strategy type with several replicas.
    """
    if distributed is False:
        return None
    strategy = compat.model_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is None:
        if distributed:
            raise ValueError(
                "distributed=True, but the model was not built under a tf.distribute strategy scope and "
                "no strategy scope is active. Build the model inside `with strategy.scope():` or call "
                "normflat.analyze inside it."
            )
        return None
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "normflat.analyze was called inside strategy.run (a replica context); call it from the "
            "outer program: it distributes the work over the replicas itself."
        )
    supported = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy,
                 tf.distribute.OneDeviceStrategy)
    if not isinstance(strategy, supported):
        if strategy.num_replicas_in_sync == 1 and not distributed:
            return None
        raise NotImplementedError(
            f"normflat distributes over MirroredStrategy and MultiWorkerMirroredStrategy, not "
            f"{type(strategy).__name__}. Pass distributed=False to analyze on one device."
        )
    if strategy.num_replicas_in_sync < 2:
        return None  # one replica: the single-device path computes the same, without overhead
    return strategy


def worker_count(strategy: Any) -> int:
    """Number of workers (processes) of the strategy's cluster (1 without a cluster)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return sum(len(v) for k, v in spec.items() if k in ("chief", "worker")) or 1


def worker_rank(strategy: Any) -> int:
    """This worker's rank among :func:`worker_count` (chief first, then the workers by index)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 0
    spec = resolver.cluster_spec().as_dict()
    task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    chiefs = len(spec.get("chief", []))
    return task_id if task_type == "chief" else chiefs + task_id


class Replicas:
    """This worker's replicas of ``strategy``: run one function on several of them in parallel."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.total = int(strategy.num_replicas_in_sync)
        self.devices = list(strategy.extended.worker_devices)
        ids: list[int] = []

        def record(ctx):
            ids.append(int(ctx.replica_id_in_sync_group))
            return tf.constant(0)

        # The global ids of this worker's replicas, in local order (public API only).
        strategy.experimental_distribute_values_from_function(record)
        self.ids = ids
        self.local = len(ids)

    def describe(self) -> dict[str, Any]:
        """Backend metadata of the strategy."""
        return {
            "distributed": type(self.strategy).__name__,
            "replicas": self.total,
            "workers": worker_count(self.strategy),
            "replica_devices": list(self.devices),
        }

    def call(self, fn: Callable[..., Any], per_replica: list[tuple], shared: tuple = ()) -> list[Any]:
        """``fn(*per_replica[i], *shared)`` on every local replica ``i``, in parallel; the local results."""

        def value(ctx):
            i = self.ids.index(int(ctx.replica_id_in_sync_group))
            with tf.device(self.devices[i]):
                return tf.nest.map_structure(tf.identity, per_replica[i])

        args = self.strategy.experimental_distribute_values_from_function(value)
        out = self.strategy.run(fn, args=tuple(args) + tuple(shared))
        flat = [self.strategy.experimental_local_results(v) for v in tf.nest.flatten(out)]
        return [tf.nest.pack_sequence_as(out, [f[i] for f in flat]) for i in range(self.local)]

    def reduce_sum(self, vector: Any) -> Any:
        """Sum over all workers of one float64 vector per worker (on local replica 0; zeros on the others)."""
        zeros = tf.zeros_like(vector)

        def value(ctx):
            i = self.ids.index(int(ctx.replica_id_in_sync_group))
            with tf.device(self.devices[i]):
                return tf.identity(vector if i == 0 else zeros)

        values = self.strategy.experimental_distribute_values_from_function(value)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)


class StrategyComm:
    """:class:`normflat.engine.distributed.Comm` over a multi-worker strategy's collectives.

    Every collective is one ``strategy.reduce(SUM)`` of a float64 vector (ints and
    pickled bytes are exact in float64), so it works on any device and for any
    number of replicas per worker.
    """

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.rank = worker_rank(replicas.strategy)
        self.size = worker_count(replicas.strategy)

    def _sum(self, vector: np.ndarray) -> np.ndarray:
        return np.asarray(self.replicas.reduce_sum(tf.constant(vector, tf.float64)).numpy())

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        total = self._sum(np.asarray(values, dtype=np.float64))
        return [int(round(float(v))) for v in total]

    def gather(self, obj: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = np.zeros(self.size)
        lengths[self.rank] = data.size
        lengths = self._sum(lengths).astype(np.int64)
        width = int(lengths.max())
        slots = np.zeros((self.size, width))
        slots[self.rank, :data.size] = data
        slots = self._sum(slots.reshape(-1)).reshape(self.size, width)
        return [pickle.loads(np.rint(slots[r, :lengths[r]]).astype(np.uint8).tobytes()) for r in range(self.size)]

    def sum_arrays(self, arrays: list[Any]) -> list[Any]:
        # The leaves travel as one flat vector: a single collective for all layers.
        shapes = [a.shape for a in arrays]
        flat = tf.concat([tf.reshape(tf.cast(a, tf.float64), [-1]) for a in arrays], 0)
        total = self.replicas.reduce_sum(flat)
        parts = tf.split(total, [int(np.prod(s)) for s in shapes])
        return [tf.reshape(p, s) for p, s in zip(parts, shapes)]
