"""What the JAX estimator kernels share: compiled chunks, pieces of a batch, sharding.

A kernel (:mod:`~normflat.backends.jax.hvp`, :mod:`~normflat.backends.jax.ggn`)
is built once per traced program and options and cached: it holds only the
jit-compiled chunk functions, which are thread-safe. Everything that belongs to
one analysis (the weights, the mesh, the piece size, the probes) lives in a
:class:`Run`, so two analyses of the same architecture may run in two threads.

For every batch a kernel returns the batch's per-layer ``(K, *native shape)``
sums, which the session adds to the engine's estimator state
(:mod:`normflat.engine.estimators`), and the batch's
:func:`normflat.engine.losses.logit_stats`, computed inside the same compiled
step and checked on the host later.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from normflat.backends.jax.layers import to_canonical
from normflat.core.memory import chunk_size_for
from normflat.engine.losses import LOGIT_STATS, combined_logit_stats, logit_stats
from normflat.engine.options import AnalysisOptions

__all__ = ["Kernel", "Run", "GroupSums", "combine_stats", "STATS"]


#: Length of a piece's statistics: the :data:`~normflat.engine.losses.LOGIT_STATS` of
#: :func:`~normflat.engine.losses.logit_stats`, then whether the loss value was finite (1) and
#: its size (a custom loss must return 1 number).
STATS = LOGIT_STATS + 2


def combine_stats(stats: Any) -> np.ndarray:
    """Combine rows of piece statistics (pieces, devices) into the batch's."""
    s = np.asarray(stats, dtype=np.float64).reshape(-1, STATS)
    logits = combined_logit_stats(np, list(s[:, :LOGIT_STATS]))
    return np.concatenate([logits, [s[:, LOGIT_STATS].min(), s[:, LOGIT_STATS + 1].max()]])


class GroupSums:
    """The ``K`` group sums of one layer, as a sequence of ``K`` arrays.

    What the session hands to the engine's estimator state: it has the state's
    ``(K, *shape)`` ``shape``, adds element-wise and indexes by group, so the
    engine's per-group arithmetic touches each array once, without slicing a
    stacked device array eagerly (JAX's eager indexing costs more than the
    arithmetic for the few arrays of a report). ``numpy.asarray`` stacks it (the
    multi-process reduction).
    """

    __slots__ = ("parts",)

    def __init__(self, parts) -> None:
        self.parts = tuple(parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts),) + tuple(self.parts[0].shape)

    @property
    def dtype(self):
        return self.parts[0].dtype

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, k: int):
        return self.parts[k]

    def __add__(self, other: "GroupSums") -> "GroupSums":
        return GroupSums(_add_all(self.parts, tuple(other.parts)))

    def compact(self, weights, axes: tuple[int, ...]):
        """``(Σ_k weights_k · parts_k, kernel sums of every part)`` in one compiled call: what the
        engine's state keeps of a layer whose groups are kernel-summed
        (:mod:`normflat.engine.estimators`)."""
        mean, reduced = _compact(tuple(float(w) for w in weights), tuple(axes), self.parts)
        return mean, GroupSums(reduced)

    def __array__(self, dtype=None, copy=None):
        out = np.stack([np.asarray(jax.device_get(p)) for p in self.parts])
        return out if dtype is None else out.astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compact(weights, axes, parts):
    mean = sum(w * p for w, p in zip(weights, parts))
    return mean, tuple(jnp.sum(p, axis=axes, keepdims=True) for p in parts)


@jax.jit
def _add_all(a, b):
    return tuple(x + y for x, y in zip(a, b))


@functools.partial(jax.jit, static_argnums=0)
def _split_groups(layouts, vals):
    # (K, *native) per layer -> K canonical (out, in/groups, *k) arrays per layer, in one compiled
    # call: the transposes of flax and multi-axis kernels fuse with the split instead of costing one call each.
    return [tuple(to_canonical(v[k], lay) for k in range(v.shape[0])) for lay, v in zip(layouts, vals)]


class Run:
    """The per-analysis state of a kernel: weights, other leaves, mesh and piece size."""

    def __init__(self, kernel: "Kernel", ws: list, others: list, mesh: Any) -> None:
        if mesh is not None and mesh.size > 1:
            self.ndev, self.mesh = mesh.size, mesh
            self.data_sharding = NamedSharding(mesh, PartitionSpec("data"))
            self.replicated = NamedSharding(mesh, PartitionSpec())
            ws, others = self.replicate(ws), self.replicate(others)
        else:
            self.ndev, self.mesh, self.data_sharding, self.replicated = 1, None, None, None
        self.ws, self.others = ws, others
        self.block: int | None = None
        #: Examples per device and compiled call chosen on the first batch (None: whole batches).
        self.chunk: int | None = None
        self.extras: dict = {}  # kernel-specific per-analysis arrays (probes, masks)

    def replicate(self, leaves):
        return [jax.device_put(a, self.replicated) if isinstance(a, (jax.Array, np.ndarray)) else a
                for a in leaves]

    def shard(self, arrays: list) -> list:
        """Place batch pieces with their leading axis split over the mesh."""
        return [jax.device_put(a, self.data_sharding) for a in arrays]


class Kernel:
    """One estimator over one traced program; reusable for models with the same program."""

    #: Positions of the batch-sharded arguments of ``_chunk``.
    batch_args: tuple = (2, 3)
    #: Independent group estimates K.
    G = 1
    #: Largest number of examples per device and compiled call (None: the whole first batch).
    max_block: int | None = None
    #: Whether padded examples are masked by labels -1 (the loss kernels) or by a weight vector (GGN).
    label_mask = True

    def __init__(self, options: AnalysisOptions, prog, ws, dtype, num_classes: int, settings: dict):
        self.options, self.prog = options, prog
        self.shapes = [tuple(w.shape) for w in ws]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.dtype, self.num_classes, self.settings = dtype, num_classes, settings
        self.paths = ["hvp"] * len(ws)
        #: Why each weight takes the generic GGN path (:class:`~normflat.backends.jax.ggn.GGN`); None here.
        self.reasons: list[str | None] = [None] * len(ws)
        # Token logits (method §6.3): the per-example output is (tokens, classes).
        out = prog.out_refs[0] if len(prog.out_refs) == 1 else None
        out_shape = tuple(prog.shapes.get(out[1], ())) if out is not None and out[0] == "ref" else ()
        self.tokens = int(out_shape[0]) if len(out_shape) == 2 else None
        # Compiled chunks other than the plain one: per (mesh or None, static variant, :meth:`variant`).
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self._jit = jax.jit(self._chunk)

    # ------------------------------------------------------------------ per analysis

    def begin(self, ws, others, mesh, *, seed: int, stream: int, weights=None) -> Run:
        """A :class:`Run` for these weights.

        Args:
            ws, others: The weight leaves (model order) and the other leaves.
            mesh: The local device mesh, or None.
            seed: The analysis seed.
            stream: The rank of a multi-process run (0 otherwise).
            weights: The :class:`~normflat.backends.jax.layers.WeightInfo` of ``ws``.
        """
        run = Run(self, ws, others, mesh)
        if weights is None or len(weights) != len(ws):
            raise ValueError("Kernel.begin needs the WeightInfo of every weight (their layouts).")
        run.layouts = tuple(w.layout for w in weights)
        return run

    def _chunk(self, *args):  # pragma: no cover - every kernel defines it
        raise NotImplementedError

    def call(self, run: Run, args: list, sharded: bool):
        """The compiled chunk on one piece: ``(values, stats)``.

        On a mesh the chunk runs under :func:`jax.shard_map`: every device evaluates
        it on its slice of the piece and returns its own partial sums, stacked on a
        leading device axis; the session sums them on the host in a fixed order.
        (XLA's in-process CPU all-reduce can deadlock when several sharded
        executables are in flight on a machine with few cores.)
        """
        static = self.variant(run)
        if not sharded and not static:
            return self._jit(*args)
        key = (run.mesh if sharded else None, tuple(sorted(static.items())))
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                chunk = functools.partial(self._chunk, **static) if static else self._chunk
                fn = self._compiled[key] = (self._make_sharded(run.mesh, len(args), chunk) if sharded
                                            else jax.jit(chunk))
        return fn(*args)

    def variant(self, run: Run) -> dict:
        """Static keyword arguments of ``_chunk`` chosen per run (a kernel is shared by the runs of
        one architecture, whose batches may differ); each variant is compiled once. None here."""
        return {}

    def _make_sharded(self, mesh, nargs: int, chunk):
        spec_b, spec_r = PartitionSpec("data"), PartitionSpec()
        in_specs = tuple(spec_b if i in self.batch_args else spec_r for i in range(nargs))

        def body(*args):
            return jax.tree_util.tree_map(lambda a: a[None], chunk(*args))

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec_b, check_vma=False))

    # ------------------------------------------------------------------ batches

    def pieces(self, run: Run, xl: list, y: Any, n: int):
        """Split a batch into pieces of exactly ``block`` examples, padding the last one.

        Every compiled call then sees the same shapes (one compilation per analysis,
        however the batch sizes vary); padded examples repeat a real one and carry
        weight 0 (label -1 for the loss kernels, mask 0 for the GGN). A callable loss
        sees whole unpadded batches (it averages itself).

        Yields:
            ``(xl, y, mask, start, length, sharded)`` per piece.
        """
        if callable(self.options.loss):
            sharded = run.mesh is not None and n % run.ndev == 0
            if run.mesh is not None and not sharded:
                # A callable loss sees the unpadded batch; one that does not split evenly stays whole.
                xl, y = run.replicate(xl), jax.device_put(y, run.replicated)
            elif sharded:
                xl, y = run.shard(xl), run.shard([y])[0]
            yield xl, y, None, 0, n, sharded
            return
        if run.block is None:
            # Chosen on the first batch; counts examples per device: a mesh of d devices takes d
            # times as many.
            run.chunk = self.block_for(run, -(-n // run.ndev))
            b = n if run.chunk is None else min(n, run.chunk * run.ndev)
            # On a mesh every piece splits evenly over the devices (padding masked out).
            run.block = -(-b // run.ndev) * run.ndev
        b = run.block
        for s in range(0, n, b):
            e = min(s + b, n)
            if e - s == b:
                xp = [a[s:e] for a in xl] if (s, e) != (0, n) else xl
                yp = y[s:e] if (s, e) != (0, n) and y is not None else y
                mask = self._ones(run, b)
            else:
                idx = jnp.concatenate([jnp.arange(s, e), jnp.full(b - (e - s), s)])
                xp = [jnp.take(a, idx, axis=0) for a in xl]
                yp = jnp.take(y, idx, axis=0) if y is not None else None
                valid = jnp.arange(b) < e - s
                mask = valid.astype(self.dtype)
                if yp is not None and self.label_mask:
                    # label -1: a zero one-hot row, no loss (token labels: every token of the row)
                    yp = jnp.where(valid.reshape((-1,) + (1,) * (yp.ndim - 1)), yp, -1)
            sharded = run.mesh is not None
            if sharded:
                xp = run.shard(xp)
                yp = run.shard([yp])[0] if yp is not None else None
                mask = run.shard([mask])[0]
            yield xp, yp, mask, s, e - s, sharded

    def block_for(self, run: Run, n: int) -> int | None:
        """Examples per device and compiled call, chosen for a first batch of ``n`` examples per
        device (None: whole batches). Default: :attr:`max_block`."""
        return self.max_block

    def _ones(self, run: Run, b: int):
        ones = run.extras.get(("ones", b))
        if ones is None:
            ones = run.extras[("ones", b)] = jnp.ones(b, self.dtype)
        return ones

    def reduce(self, run: Run, vals: list, sharded: bool) -> list:
        """Per-device partial sums -> one ``(K, *shape)`` array per layer (host sum, fixed order)."""
        if not sharded:
            return vals
        return [jnp.asarray(np.asarray(jax.device_get(v)).sum(axis=0)) for v in vals]

    def batch(self, run: Run, xl: list, y: Any, n: int, offset: int) -> tuple[list, list]:
        """The batch's per-layer sums (:class:`GroupSums` of canonical arrays) and piece statistics."""
        total = None
        stats = []
        for piece in self.pieces(run, xl, y, n):
            vals, st, sharded = self.run_piece(run, piece, offset)
            vals = self.reduce(run, vals, sharded)
            total = vals if total is None else _add_all(tuple(total), tuple(vals))
            stats.append(st)
        return [GroupSums(g) for g in _split_groups(run.layouts, list(total))], stats

    def run_piece(self, run: Run, piece, offset: int):  # pragma: no cover - every kernel defines it
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def _activation_elements(self) -> int:
        """Elements of all intermediate values of the per-example forward program."""
        return sum(math.prod(self.prog.shapes.get(r, ())) for op in self.prog.ops for r in op.outs)

    def _budget_block(self, bytes_per_example: int, what: str) -> int | None:
        """Examples per device and compiled call within ``memory_budget`` (None: no budget)."""
        budget = self.settings.get("memory_budget")
        if budget is None:
            return None
        return chunk_size_for(budget, max(1, int(bytes_per_example)), what=what)

    def logits(self, ws, others, xl):
        """Batch logits: the per-example program vmapped over the examples."""
        return jax.vmap(lambda xi: self.prog.run(ws, others, xi)[0])(xl)

    def stats(self, z, loss=None):
        """A piece's statistics (inside the compiled chunk): logit stats, loss finite, loss size."""
        finite = jnp.ones((), z.dtype) if loss is None else jnp.all(jnp.isfinite(loss)).astype(z.dtype)
        size = jnp.ones((), z.dtype) if loss is None else jnp.asarray(float(np.size(loss)), z.dtype)
        return jnp.concatenate([logit_stats(jnp, z), finite[None], size[None]])

