"""Hessian-vector-product kernels of the JAX backend: ``exact`` and ``hutchinson`` (method §6).

Both differentiate the batch loss twice, forward over reverse (``jax.jvp`` of
``jax.grad``), vectorised over tangents with ``jax.vmap``. The loss is the
engine's :func:`normflat.engine.losses.loss_sum` (built-in losses) or the user's
callable times the batch size.

``hutchinson`` uses the engine's Rademacher probes
(:func:`normflat.engine.random.rademacher`), drawn once per analysis in the
canonical ``(out, in/groups, *k)`` layout and converted to each leaf's layout:
the same probes for every batch and every rank, so that the sum over batches of
``v ⊙ H_b v`` is ``v ⊙ H v`` of the mean loss, whatever the batch split, and the
same as in every other framework.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax.kernel import Kernel, Run
from normflat.backends.jax.layers import canonical_shape
from normflat.engine.losses import loss_sum
from normflat.engine.random import rademacher

__all__ = ["Exact", "Hutchinson"]


class _LossKernel(Kernel):
    """A kernel that differentiates the batch loss."""

    def loss_and_logits(self, ws, others, xl, y):
        """``(summed loss, logits)`` of a piece (a callable loss: batch size times its mean)."""
        z = self.logits(ws, others, xl)
        if callable(self.options.loss):
            value = self.options.loss(z, y)
            # Static at trace time; the session reports it with the engine's message.
            self.loss_shape = tuple(jnp.shape(value))
            if jnp.size(value) != 1:
                # Checked on the host with the engine's message (check_loss_value).
                value = jnp.sum(value)
            return z.shape[0] * jnp.reshape(value, ()), (z, value)
        value = loss_sum(jnp, z, y, self.options)
        return value, (z, value)

    def _hvps(self, ws, others, xl, y, tangents):
        grad = jax.grad(lambda w_: self.loss_and_logits(w_, others, xl, y), has_aux=True)

        def hvp(t):
            return jax.jvp(lambda w_: grad(w_)[0], (ws,), (t,))[1]

        hv = jax.vmap(hvp)(tangents)
        _, (z, value) = self.loss_and_logits(ws, others, xl, y)
        return hv, self.stats(z, value)


class Exact(_LossKernel):
    """One Hessian-vector product per weight entry (basis vectors, ``exact_chunk`` at a time)."""

    def __init__(self, options, prog, ws, dtype, num_classes, settings):
        self.total = sum(int(np.prod(w.shape, dtype=np.int64)) for w in ws)
        self.basis = min(int(settings["exact_chunk"]), self.total)
        super().__init__(options, prog, ws, dtype, num_classes, settings)
        # Per example: primal, tangent and cotangent of every intermediate, per basis vector.
        self.max_block = self._budget_block(
            3 * self.basis * self._activation_elements() * jnp.dtype(self.dtype).itemsize,
            f"the exact Hessian-vector products ({self.basis} basis vectors per step, exact_chunk)")

    def _chunk(self, ws, others, xl, y, start):
        def tangent(i):
            e = jax.nn.one_hot(i, self.total, dtype=self.dtype)
            parts, o = [], 0
            for w in ws:
                parts.append(e[o:o + w.size].reshape(w.shape))
                o += w.size
            return parts

        basis = jax.vmap(tangent)(start + jnp.arange(self.basis))
        hv, stats = self._hvps(ws, others, xl, y, basis)
        return sum(jnp.sum((h * e).reshape(self.basis, -1), axis=1) for h, e in zip(hv, basis)), stats

    def run_piece(self, run: Run, piece, offset: int):
        xp, yp, _, _, _, sharded = piece
        runs = [self.call(run, [run.ws, run.others, xp, yp, start], sharded)
                for start in range(0, self.total, self.basis)]
        stats = runs[0][1]
        vals = jnp.concatenate([v for v, _ in runs], axis=-1)[..., : self.total]
        out, o = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(vals[..., o:o + size].reshape(vals.shape[:-1] + (1,) + shape))
            o += size
        return out, stats, sharded


class Hutchinson(_LossKernel):
    """``Σ_j v_j ⊙ H v_j`` per group with the engine's Rademacher probes, ``probe_chunk`` at a time."""

    def __init__(self, options, prog, ws, dtype, num_classes, settings):
        self.S = options.samples
        self.G = options.groups
        self.P = min(int(settings["probe_chunk"]), self.S)
        super().__init__(options, prog, ws, dtype, num_classes, settings)
        self.max_block = self._budget_block(
            3 * self.P * self._activation_elements() * jnp.dtype(self.dtype).itemsize,
            f"the Hutchinson Hessian-vector products ({self.P} probes per step, probe_chunk)")

    def begin(self, ws, others, mesh, *, seed, stream, weights=None) -> Run:
        run = super().begin(ws, others, mesh, seed=seed, stream=stream, weights=weights)
        # The probes of the whole analysis, drawn once (int8: a quarter of float32 memory),
        # cut into chunks of P; a last short chunk is padded with zero probes (no contribution).
        chunks = []
        for s0 in range(0, self.S, self.P):
            idx = range(s0, min(s0 + self.P, self.S))
            layer_chunks = []
            for i, info in enumerate(weights):
                canon = _canonical_shape(info, self.shapes[i])
                v = info.to_native(rademacher(seed, i, idx, canon), batch_dims=1)
                if len(idx) < self.P:
                    v = np.concatenate([v, np.zeros((self.P - len(idx),) + v.shape[1:], np.int8)])
                layer_chunks.append(v)
            layer_chunks = [jnp.asarray(v) for v in layer_chunks]
            chunks.append((run.replicate(layer_chunks) if run.mesh is not None else layer_chunks, s0))
        run.extras["probes"] = chunks
        return run

    def _chunk(self, ws, others, xl, y, probes, s0):
        probes = [p.astype(self.dtype) for p in probes]
        hz, stats = self._hvps(ws, others, xl, y, probes)
        groups = (s0 + jnp.arange(self.P)) % self.G
        out = [jax.ops.segment_sum(z * h, groups, num_segments=self.G) for z, h in zip(probes, hz)]
        return out, stats

    def run_piece(self, run: Run, piece, offset: int):
        xp, yp, _, _, _, sharded = piece
        total, stats = None, None
        for probes, s0 in run.extras["probes"]:
            vals, st = self.call(run, [run.ws, run.others, xp, yp, probes, s0], sharded)
            total = vals if total is None else [t + v for t, v in zip(total, vals)]
            stats = st if stats is None else stats
        return total, stats, sharded


def _canonical_shape(info, native_shape: tuple) -> tuple:
    """The canonical ``(out, in/groups, *k)`` shape of a weight with native shape ``native_shape``."""
    return canonical_shape(native_shape, info.layout)
