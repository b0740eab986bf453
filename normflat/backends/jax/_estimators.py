"""Hessian-diagonal estimators of the JAX backend (SPEC §6).

All estimators accumulate over batches and return the diagonal of the Hessian
(or GGN) of the *mean* loss over all examples, in each weight's native layout.
Random numbers come from explicit keys derived from the seed: ggn-mc draws for
example ``i`` use ``fold_in(key(seed), i)`` and Hutchinson probe ``s`` of batch
``b`` uses ``fold_in(fold_in(key(seed), b), s)``, so results do not depend on
chunk sizes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from normflat.core.memory import chunk_size_for
from normflat.core.options import NSCE_EPS, AnalysisOptions

__all__ = ["make"]

#: Elements of per-example intermediate results one vectorised GGN chunk may hold.
_GGN_BUDGET = 2**26
#: Groups of independent estimates handed to the core for standard errors.
_MAX_GROUPS = 10


def make(options: AnalysisOptions, prog, ws, dtype, num_classes: int, settings: dict):
    """The estimator for ``options.estimator``; reusable for models with the same program (see ``reset``)."""
    cls = {"exact": _Exact, "hutchinson": _Hutchinson, "ggn": _GGN, "ggn-mc": _GGN}[options.estimator]
    return cls(options, prog, ws, dtype, num_classes, settings)


def _head(z, options: AnalysisOptions):
    """Logits -> the input of softmax cross-entropy (normalized for nsce, SPEC §7)."""
    if options.loss == "nsce":
        zc = z - jnp.mean(z, axis=-1, keepdims=True)
        return options.temperature * zc / jnp.sqrt(jnp.mean(zc * zc, axis=-1, keepdims=True) + NSCE_EPS)
    return z


def _to_canonical(a, flax: bool, batch_dims: int):
    """(*k, in, out) -> (out, in, *k) after ``batch_dims`` leading axes (identity if not flax)."""
    if not flax:
        return a
    nd = a.ndim - batch_dims
    lead = tuple(range(batch_dims))
    return jnp.transpose(a, lead + (batch_dims + nd - 1, batch_dims + nd - 2)
                         + tuple(batch_dims + i for i in range(nd - 2)))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _finish(sums, ws, examples, counts, flax):
    # One compiled call: normalisation, group means, layouts and the finiteness check.
    c = jnp.asarray(counts, sums[0].dtype)
    groups = [s / examples / c.reshape((-1,) + (1,) * (s.ndim - 1)) for s in sums]
    diags = [jnp.mean(g, axis=0) for g in groups]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for d in diags]))
    return ([_to_canonical(g, f, 1) for g, f in zip(groups, flax)],
            [_to_canonical(d, f, 0) for d, f in zip(diags, flax)],
            [_to_canonical(w, f, 0) for w, f in zip(ws, flax)], finite)


class _Base:
    """Accumulates one estimator over batches; the jit-compiled kernels only depend on the program."""

    def __init__(self, options, prog, ws, dtype, num_classes, settings):
        self.options, self.prog, self.ws = options, prog, ws
        self.dtype, self.num_classes, self.settings = dtype, num_classes, settings
        self.root = jax.random.key(options.seed)
        self.paths = ["hvp"] * len(ws)

    #: Data-parallel shardings (batch axis over the mesh, replicated), or None on one device.
    data_sharding = replicated = mesh = None
    ndev = 1
    #: Positions of the batch-sharded arguments of ``_chunk`` and of its example offset (if any).
    batch_args: tuple = (2, 3, 4)
    offset_arg: int | None = None

    def reset(self, ws, others, seed: int, mesh=None, stream: int = 0) -> None:
        """Start a new accumulation for these weights and other leaves.

        Args:
            ws, others: The weights and the other model leaves.
            seed: The analysis seed.
            mesh: A 1-D ``jax.sharding.Mesh`` with axis ``"data"`` to shard every batch
                piece over (weights replicated), or None for one device. The jitted
                kernels reduce over the sharded batch axis, so XLA inserts the
                cross-device sums.
            stream: Random stream index (the process index in a multi-process run),
                folded into the seed so that processes draw independent probes.
        """
        if mesh is not None and mesh.size > 1:
            self.ndev, self.mesh = mesh.size, mesh
            self.data_sharding = NamedSharding(mesh, PartitionSpec("data"))
            self.replicated = NamedSharding(mesh, PartitionSpec())
            ws, others = self._replicate(ws), self._replicate(others)
        else:
            self.ndev, self.mesh, self.data_sharding, self.replicated = 1, None, None, None
        self.ws, self.others = ws, others
        if getattr(self, "_seed", None) != (seed, stream):
            root = jax.random.key(seed)
            self._seed, self.root = (seed, stream), (jax.random.fold_in(root, stream) if stream else root)
        self.sums = None  # set by the first batch (no zero arrays to dispatch)
        self.extra = None  # on a mesh: sums of pieces that were not sharded (callable loss)
        self.block = None
        self._piece_sharded = False

    def _replicate(self, leaves):
        return [jax.device_put(a, self.replicated) if isinstance(a, (jax.Array, np.ndarray)) else a
                for a in leaves]

    def _shard(self, xl, y, mask):
        """Place a batch piece with its batch axis split over the mesh (no-op on one device)."""
        self._piece_sharded = False
        if self.data_sharding is None:
            return xl, y, mask
        if mask is None and int(y.shape[0]) % self.ndev:
            # A callable loss sees the unpadded batch; one that does not split evenly stays whole.
            return self._replicate(xl), jax.device_put(y, self.replicated), None
        self._piece_sharded = True
        put = functools.partial(jax.device_put, device=self.data_sharding)
        return [put(a) for a in xl], put(y), (None if mask is None else put(mask))

    def run(self, *args):
        """The compiled chunk on the current piece: ``(values, stacked)``.

        On a mesh the chunk runs under :func:`jax.shard_map`: every device
        evaluates it on its slice of the batch and returns its own partial sums,
        stacked on a leading device axis (``stacked=True``). The partial sums are
        added elementwise over batches and summed over devices once, in
        :meth:`reduce_devices`, so the per-batch steps contain no collective.
        (XLA's in-process CPU all-reduce can deadlock when several sharded
        executables are in flight on a machine with few cores; one exchange per
        analysis is also cheaper than one per step.)
        """
        if not self._piece_sharded:
            return self._jit(*args), False
        fn = self._sharded.get(self.mesh) if hasattr(self, "_sharded") else None
        if fn is None:
            fn = self._make_sharded(len(args))
        return fn(*args), True

    def _make_sharded(self, nargs: int):
        spec_b, spec_r = PartitionSpec("data"), PartitionSpec()
        in_specs = tuple(spec_b if i in self.batch_args else spec_r for i in range(nargs))
        off, last = self.offset_arg, self.batch_args[-1]

        def body(*args):
            args = list(args)
            if off is not None:
                # Global index of this device's first example: random draws follow examples, not devices.
                args[off] = args[off] + jax.lax.axis_index("data") * args[last].shape[0]
            return jax.tree_util.tree_map(lambda a: a[None], self._chunk(*args))

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=spec_b, check_vma=False))
        if not hasattr(self, "_sharded"):
            self._sharded = {}
        self._sharded[self.mesh] = fn
        return fn

    def _accumulate(self, vals, stacked: bool = False) -> None:
        if self.mesh is not None and not stacked:
            self.extra = list(vals) if self.extra is None else [s + v for s, v in zip(self.extra, vals)]
            return
        self.sums = list(vals) if self.sums is None else [s + v for s, v in zip(self.sums, vals)]

    def reduce_devices(self) -> None:
        """Sum the per-device partial sums (host side, fixed order: deterministic)."""
        if self.mesh is None:
            return
        total = None
        if self.sums is not None:
            total = [np.asarray(jax.device_get(a)).sum(axis=0) for a in self.sums]
        if self.extra is not None:
            extra = [np.asarray(jax.device_get(a)) for a in self.extra]
            total = extra if total is None else [t + e for t, e in zip(total, extra)]
        self.sums = [jnp.asarray(t) for t in total]
        self.extra = None
        self.mesh = self.data_sharding = None
        self.ws = [np.asarray(jax.device_get(w)) if isinstance(w, jax.Array) else w for w in self.ws]

    def _activation_elements(self) -> int:
        """Elements of all intermediate values of the per-example forward program."""
        return sum(math.prod(self.prog.shapes.get(r, ())) for op in self.prog.ops for r in op.outs)

    def _budget_block(self, bytes_per_example: int, what: str) -> int | None:
        """Examples per device and compiled call within ``memory_budget`` (None: no budget)."""
        budget = self.settings.get("memory_budget")
        if budget is None:
            return None
        return chunk_size_for(budget, max(1, int(bytes_per_example)), what=what)

    def _ones(self, b):
        if getattr(self, "_ones_cache", (None, None))[0] != b:
            self._ones_cache = (b, jnp.ones(b, self.dtype))
        return self._ones_cache[1]

    G = 1
    #: Largest number of examples per compiled call (None: the whole first batch).
    max_block: int | None = None

    def pieces(self, xl, y, n):
        """Split a batch into pieces of exactly ``block`` examples, padding the last one.

        Every compiled call then sees the same shapes (one compilation per analysis,
        however the batch sizes vary); padded examples repeat a real one and carry
        weight 0. A callable loss sees whole unpadded batches (it averages itself).
        """
        if callable(self.options.loss):
            yield (*self._shard(xl, y, None), 0)
            return
        if self.block is None:
            # max_block counts examples per device: a mesh of d devices takes d times as many.
            b = n if self.max_block is None else min(n, self.max_block * self.ndev)
            # On a mesh every piece splits evenly over the devices (padding masked out).
            self.block = -(-b // self.ndev) * self.ndev
        b = self.block
        for s in range(0, n, b):
            e = min(s + b, n)
            if e - s == b:
                yield (*self._shard([a[s:e] for a in xl] if (s, e) != (0, n) else xl,
                                    y[s:e] if (s, e) != (0, n) else y, self._ones(b)), s)
            else:
                idx = jnp.concatenate([jnp.arange(s, e), jnp.full(b - (e - s), s)])
                mask = (jnp.arange(b) < e - s).astype(self.dtype)
                yield (*self._shard([jnp.take(a, idx, axis=0) for a in xl], jnp.take(y, idx, axis=0), mask), s)

    def _counts(self):
        """Draws per group (each group's sum is divided by it); 1 when sums are already means."""
        return [1] * self.G

    def finish(self, examples, canonical: tuple):
        """Mean-loss diagonals, group estimates (or None), weights — all in canonical layout
        (``canonical[k]``: whether weight k is in flax order) — and an all-finite flag."""
        self.reduce_devices()
        groups, diags, ws, finite = _finish(self.sums, self.ws, examples, tuple(self._counts()), canonical)
        return diags, [g if self.G >= 2 else None for g in groups], ws, finite

    def logits(self, ws, others, xl):
        """Batch logits: the per-example program vmapped over the examples."""
        return jax.vmap(lambda xi: self.prog.run(ws, others, xi)[0])(xl)

    def batch_loss(self, ws, others, xl, y, mask):
        """Weighted sum of per-example losses of a batch (``n * mean`` for a callable loss)."""
        z = self.logits(ws, others, xl)
        if callable(self.options.loss):
            return z.shape[0] * self.options.loss(z, y)
        zp = _head(z, self.options)
        picked = jnp.take_along_axis(zp, y.astype(jnp.int32)[:, None], axis=-1)[:, 0]
        return jnp.sum((jax.nn.logsumexp(zp, axis=-1) - picked) * mask)


# ----------------------------------------------------------------------------- exact


class _Exact(_Base):
    """One forward-over-reverse Hessian-vector product per weight entry."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sizes = [w.size for w in self.ws]
        self.total = sum(self.sizes)
        self.basis = min(int(self.settings["exact_chunk"]), self.total)
        # Per example: primal, tangent and cotangent of every intermediate, per basis vector.
        self.max_block = self._budget_block(
            3 * self.basis * self._activation_elements() * jnp.dtype(self.dtype).itemsize,
            f"the exact Hessian-vector products ({self.basis} basis vectors per step, exact_chunk)")
        self._jit = jax.jit(self._chunk)

    def _chunk(self, ws, others, xl, y, mask, start):
        def tangent(i):
            e = jax.nn.one_hot(i, self.total, dtype=self.dtype)
            parts, o = [], 0
            for w in ws:
                parts.append(e[o:o + w.size].reshape(w.shape))
                o += w.size
            return parts

        basis = jax.vmap(tangent)(start + jnp.arange(self.basis))
        grad = jax.grad(lambda w_: self.batch_loss(w_, others, xl, y, mask))
        hv = jax.vmap(lambda e: jax.jvp(grad, (ws,), (e,))[1])(basis)
        return sum(jnp.sum((h * e).reshape(self.basis, -1), axis=1) for h, e in zip(hv, basis))

    def add_batch(self, xl, y, n, b, offset):
        for xp, yp, mask, _ in self.pieces(xl, y, n):
            runs = [self.run(self.ws, self.others, xp, yp, mask, start) for start in range(0, self.total, self.basis)]
            stacked = runs[0][1]
            vals = jnp.concatenate([v for v, _ in runs], axis=-1)[..., : self.total]
            out, o = [], 0
            for w in self.ws:
                out.append(vals[..., o:o + w.size].reshape(vals.shape[:-1] + (1,) + w.shape))
                o += w.size
            self._accumulate(out, stacked)


# ----------------------------------------------------------------------------- hutchinson


class _Hutchinson(_Base):
    """``mean_s z_s ⊙ H z_s`` with Rademacher probes (``jax.jvp`` of ``jax.grad``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.S = self.options.samples
        self.G = min(self.S, _MAX_GROUPS) if self.S >= 2 else 1
        self.P = min(int(self.settings["probe_chunk"]), self.S)
        self.max_block = self._budget_block(
            3 * self.P * self._activation_elements() * jnp.dtype(self.dtype).itemsize,
            f"the Hutchinson Hessian-vector products ({self.P} probes per step, probe_chunk)")
        self._jit = jax.jit(self._chunk)

    def _chunk(self, ws, others, xl, y, mask, bkey, s0):
        s_idx = s0 + jnp.arange(self.P)

        def probe(s):
            key = jax.random.fold_in(bkey, s)
            return [jax.random.rademacher(jax.random.fold_in(key, k), w.shape, dtype=self.dtype)
                    for k, w in enumerate(ws)]

        probes = jax.vmap(probe)(s_idx)
        grad = jax.grad(lambda w_: self.batch_loss(w_, others, xl, y, mask))
        hz = jax.vmap(lambda z: jax.jvp(grad, (ws,), (z,))[1])(probes)
        valid = (s_idx < self.S).astype(self.dtype)
        groups = s_idx % self.G
        out = []
        for z, h in zip(probes, hz):
            v = z * h * valid.reshape((-1,) + (1,) * (z.ndim - 1))
            out.append(jax.ops.segment_sum(v, groups, num_segments=self.G))
        return out

    def add_batch(self, xl, y, n, b, offset):
        for xp, yp, mask, start in self.pieces(xl, y, n):
            # Probes are drawn per batch (and per piece of a large batch).
            bkey = jax.random.fold_in(jax.random.fold_in(self.root, b), start)
            for s0 in range(0, self.S, self.P):
                self._accumulate(*self.run(self.ws, self.others, xp, yp, mask, bkey, s0))

    def _counts(self):
        return [len(range(g, self.S, self.G)) for g in range(self.G)]


# ----------------------------------------------------------------------------- ggn, ggn-mc


class _GGN(_Base):
    """Exact (or Monte-Carlo) GGN diagonal from per-example signals.

    For each example the forward program is re-run with zero perturbations on
    the tap outputs; one VJP per column of a symmetric factor of the output
    Hessian gives the signals at every tap and the per-example gradients of
    the other weights at once. Taps then form the per-example squares from
    their inputs: a dense layer as one contraction of squared inputs with
    squared signals, a convolution from per-example gradients of that layer
    only. Everything runs in one jit-compiled, vmapped chunk function.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.batch_args, self.offset_arg = (2, 3), 5
        self.mc = self.options.estimator == "ggn-mc"
        if self.mc:
            self.S = self.options.samples
            self.G = min(self.S, _MAX_GROUPS) if self.S >= 2 else 1
            self.M = math.ceil(self.S / self.G)
        else:
            # diag(p) - p p^T has rank C-1: C-1 signals per example suffice (see _columns).
            self.G, self.M = 1, self.num_classes - 1
        self.taps = {t.weight: t for t in self.prog.taps}
        self.gen = [k for k in range(len(self.ws)) if k not in self.taps]
        self.paths = ["fast" if k in self.taps else "generic" for k in range(len(self.ws))]
        per_example = 0
        for k, w in enumerate(self.ws):
            t = self.taps.get(k)
            if t is not None and t.squares_factor:
                out_size = math.prod(self.prog.shapes[self.prog.ops[t.op].outs[0]])
                act_size = math.prod(self.prog.shapes.get(self.prog.ops[t.op].ins[1 - t.weight_pos][1], (1,)))
                per_example += self.G * self.M * out_size + act_size
            else:
                per_example += self.G * self.M * w.size
        # Per example: the signals and squared gradients counted above, plus the forward
        # intermediates kept for the VJP and one back-propagated signal per column.
        need = (per_example + (1 + self.G * self.M) * self._activation_elements()) * jnp.dtype(self.dtype).itemsize
        budget_block = self._budget_block(need, "the per-sample GGN signals")
        self.max_block = int(self.settings["chunk_size"] or budget_block
                             or max(1, _GGN_BUDGET // max(per_example, 1)))
        self._jit = jax.jit(self._chunk)

    def _columns(self, zp, key):
        """(G, M, C) columns V with sum_j v_j v_j^T = softmax-CE Hessian (or its MC estimate)."""
        p = jax.nn.softmax(zp)
        if not self.mc:
            # diag(p) - p p^T = S (I - q q^T) S with S = diag(q), q = sqrt(p), |q| = 1. The
            # Householder reflection H = I - c u u^T, u = q + e_last, maps q to -e_last, so
            # I - q q^T = H (I - e_last e_last^T) H and the C-1 rows (H S)_j, j < C-1, factor
            # the Hessian: one back-propagated signal fewer than the C rows sqrt(p_c)(e_c - p).
            # u_last = q_last + 1 >= 1, so c = 2 / |u|^2 never divides by a small number.
            q = jnp.sqrt(p)
            u = q.at[-1].add(1.0)
            c = 2.0 / jnp.sum(u * u)
            h = jnp.eye(p.shape[0], dtype=p.dtype)[:-1] - c * u[:-1, None] * u[None, :]
            return (h * q[None, :])[None]
        n_slots = self.G * self.M
        labels = jax.random.categorical(key, jnp.log(p), shape=(n_slots,))
        s = jnp.arange(n_slots)
        counts = jnp.asarray([len(range(g, self.S, self.G)) for g in range(self.G)], p.dtype)
        scale = jnp.where(s < self.S, 1.0 / jnp.sqrt(counts[s % self.G]), 0.0).astype(p.dtype)
        cols = (p[None, :] - jax.nn.one_hot(labels, p.shape[0], dtype=p.dtype)) * scale[:, None]
        # Slot s belongs to group s % G.
        return cols.reshape(self.M, self.G, -1).transpose(1, 0, 2)

    def _group_sum(self, v):
        return v.reshape((self.G, self.M) + v.shape[1:]).sum(axis=1)

    def _per_example(self, ws, others, xl, key):
        prog, taps, gen = self.prog, self.taps, self.gen
        eps0 = {t.op: jnp.zeros(prog.shapes[prog.ops[t.op].outs[0]], self.dtype) for t in taps.values()}

        def fwd(eps, wg):
            w_all = list(ws)
            for k, w in zip(gen, wg):
                w_all[k] = w
            rec: dict = {}
            (z,) = prog.run(w_all, others, xl, eps, rec, fast_pool=True)
            return _head(z, self.options), rec

        zp, vjp_fn, rec = jax.vjp(fwd, eps0, [ws[k] for k in gen], has_aux=True)
        cols = self._columns(zp, key).reshape(self.G * self.M, -1)
        d_eps, d_wg = jax.vmap(vjp_fn)(cols)
        out = {}
        for j, k in enumerate(gen):
            out[k] = self._group_sum(d_wg[j] ** 2)
        for k, t in taps.items():
            a, d = rec[t.op], d_eps[t.op]
            if t.squares_factor:
                out[k] = (a * a, self._group_sum(d * d))
            elif self._conv_patches_ok(t, a):
                out[k] = self._conv_squares(t, a, d, prog.layout_fn(t)(ws[k]).shape)
            else:
                f, wp = prog.tap_fn(t), prog.layout_fn(t)(ws[k])
                _, vjp_w = jax.vjp(lambda w_: f(a, w_), wp)
                grads = jax.vmap(lambda dd: vjp_w(dd)[0])(d)
                out[k] = self._group_sum(grads**2)
        return out

    def _conv_patches_ok(self, t, a) -> bool:
        op = self.prog.ops[t.op]
        prm = op.params
        return (op.prim.name == "conv_general_dilated" and t.weight_pos == 1
                and prm["batch_group_count"] == 1 and all(v == 1 for v in (prm["lhs_dilation"] or ()))
                and a.shape[prm["dimension_numbers"].lhs_spec[0]] == 1)

    def _conv_squares(self, t, a, d, wp_shape):
        """Sum over signals of squared per-example conv-kernel gradients, from input patches.

        The per-example gradient for signal j is ``delta_j (out, positions) @ patches
        (positions, in*k)`` per group: one batched matmul instead of a convolution per
        example and signal. Returned in the layout of the kernel operand.
        """
        prm = self.prog.ops[t.op].params
        dn = prm["dimension_numbers"]
        ks = [wp_shape[i] for i in dn.rhs_spec[2:]]
        out_ch, in_g = wp_shape[dn.rhs_spec[0]], wp_shape[dn.rhs_spec[1]]
        g = prm["feature_group_count"]
        patches = jax.lax.conv_general_dilated_patches(
            jnp.transpose(a, dn.lhs_spec), ks, prm["window_strides"], prm["padding"],
            rhs_dilation=prm["rhs_dilation"], precision=jax.lax.Precision.HIGHEST)  # (1, C*K, *out)
        pm = patches.reshape(g, in_g * math.prod(ks), -1)
        cols = d.shape[0]
        dm = jnp.transpose(d, (0,) + tuple(1 + i for i in dn.out_spec)).reshape(cols, g, out_ch // g, -1)
        # Output order (group, signal, out, in*k) is the natural dot_general order: no transpose of
        # the largest array; squares are summed over the signals of each estimate group.
        grads = jnp.einsum("gjop,gkp->gjok", jnp.swapaxes(dm, 0, 1), pm)
        sq = (grads * grads).reshape(g, self.G, self.M, out_ch // g, -1).sum(axis=2)
        sq = jnp.swapaxes(sq, 0, 1).reshape((self.G, out_ch, in_g, *ks))
        inv = [int(i) for i in np.argsort(dn.rhs_spec)]
        return jnp.transpose(sq, (0,) + tuple(1 + i for i in inv))

    def _chunk(self, ws, others, xl, mask, root, offset):
        m = mask.shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(root, i))(offset + jnp.arange(m))
        outs = jax.vmap(self._per_example, in_axes=(None, None, 0, 0))(ws, others, xl, keys)

        def masked_sum(v):
            return jnp.tensordot(mask, v, axes=1)

        res = []
        for k, w in enumerate(ws):
            t = self.taps.get(k)
            if t is None:
                res.append(masked_sum(outs[k]))
                continue
            layout = self.prog.layout_fn(t)
            wp = layout(w)
            if t.squares_factor:
                a2, d2 = outs[k]
                a2 = a2 * mask.reshape((-1,) + (1,) * (a2.ndim - 1))
                f = self.prog.tap_fn(t)
                # sum_n,c (delta_nc^2)(a_n^2)^T: the tap's own weight VJP applied to squares.
                _, vjp_sq = jax.vjp(lambda w_: jax.vmap(lambda a: f(a, w_))(a2), wp)
                dwp = jax.vmap(lambda d: vjp_sq(d)[0], in_axes=1)(d2)
            else:
                dwp = masked_sum(outs[k])
            _, vjp_layout = jax.vjp(layout, w)
            res.append(jax.vmap(lambda v: vjp_layout(v)[0])(dwp))
        return res

    def add_batch(self, xl, y, n, b, offset):
        # The GGN does not depend on the labels: a callable loss is rejected earlier.
        for xp, _, mask, s in self.pieces(xl, y, n):
            self._accumulate(*self.run(self.ws, self.others, xp, mask, self.root, offset + s))
