"""GGN kernels of the JAX backend: ``ggn``, ``ggn-topk`` and ``ggn-mc`` (method §6).

For each example the traced forward program (:mod:`~normflat.backends.jax.program`)
is re-run with zero perturbations on the tap outputs. The output signals are the
engine's (:func:`normflat.engine.losses.output_signals`): the ``C − 1`` columns
of a factor of the loss Hessian in the logits (``ggn``), the exact signals of the
top classes plus draws of the rest (``ggn-topk``, method §6.2), or
``(e_ỹ − p)/√m_k`` with labels drawn from the engine's uniforms (``ggn-mc``); the
uniforms come from :func:`normflat.engine.random.sample_uniforms` keyed on the
sample's position in the data stream, so the draws do not depend on the batch
split. The signals are pulled back through the normalization for ``nsce``; they
are laid out ``(K', M)`` per example (``K' = options.state_groups`` sums, ``M =
options.signals_per_group(C)`` signals each, zero padding included). One VJP per
signal gives the signals at every tap and the per-example gradients of the other
weights at once. Taps then
form the per-example squares from their inputs: a dense layer as one contraction
of squared inputs with squared signals, a convolution from per-example gradients
of that layer only (input patches and one batched matmul), an embedding lookup
as a scatter of squared output signals (:meth:`GGN._lookup_squares`: per example
the signals of equal ids are summed, then squared and added into their table
rows; never a ``(n, V, d)`` array).

With ``ggn-topk`` a dense *head* tap (a layer whose output is the logits,
:attr:`~normflat.backends.jax.program.Tap.head`) takes its squares from the
engine's :func:`~normflat.engine.losses.diagonal_signals` instead: one signal per
sample (per token), whose square is the logit-Hessian diagonal, which gives that
layer its exact GGN diagonal in the shared group 0 and zeros in the sampled ones,
as the torch and Keras backends do (method §6.2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax.kernel import Kernel, Run
from normflat.engine.losses import diagonal_signals, output_signals, token_signals
from normflat.engine.random import sample_uniforms

__all__ = ["GGN"]

#: Elements of per-example intermediate results one vectorised GGN chunk may hold.
_GGN_BUDGET = 2**26


def _balance(a, d):
    """``(a·t, d/t)`` with ``t`` a power of 2 that gives both the same magnitude (per example).

    The dense path squares the activation and the signals separately; their product is
    a squared gradient entry, but each factor alone can leave the float32 range (logits
    near 1e20 give signals near 1e-20, whose squares underflow). Scaling by a power of
    2 is exact, so the product is unchanged.
    """
    ma, md = jnp.max(jnp.abs(a)), jnp.max(jnp.abs(d))
    ok = (ma > 0) & (md > 0) & jnp.isfinite(ma) & jnp.isfinite(md)
    e = jnp.round(0.5 * (jnp.log2(jnp.where(ok, md, 1)) - jnp.log2(jnp.where(ok, ma, 1))))
    t = jnp.exp2(e).astype(a.dtype)
    return a * t, d / t


class GGN(Kernel):
    """Exact, top-k or Monte-Carlo GGN diagonal from per-example signals.

    ``options`` must be resolved (not ``"auto"``): the layout of the signals, the
    number of sums ``G = options.state_groups`` and the head taps depend on it.
    """

    batch_args = (2, 3, 4)
    label_mask = False

    def __init__(self, options, prog, ws, dtype, num_classes, settings):
        # Uniforms per example (per token) the estimator consumes: 0 for the exact ggn.
        self.draws = options.draws
        # K' sums of M signals each (ggn: diag(p) - p p^T has rank C-1, engine.losses.ggn_factor).
        self.G = options.state_groups
        self.M = options.signals_per_group(num_classes)
        self.taps = {t.weight: t for t in prog.taps}
        # ggn-topk: dense heads get the exact diagonal from one signal (program.Tap.head).
        self.heads = {k for k, t in self.taps.items() if t.head is not None} \
            if options.estimator == "ggn-topk" else set()
        self.gen = [k for k in range(len(ws)) if k not in self.taps]
        super().__init__(options, prog, ws, dtype, num_classes, settings)
        # Token logits (method §6.3): every (token, signal) pair is its own back-propagated signal, and
        # the counted-token mask of the piece is one more batch input (not a Python branch).
        self.T = self.tokens or 1
        self.cols = self.M * self.T
        if self.tokens is not None:
            self.batch_args = (2, 3, 4, 5)
        self.paths = ["fast" if k in self.taps else "generic" for k in range(len(ws))]
        per_example = 0
        for k, w in enumerate(ws):
            t = self.taps.get(k)
            if k in self.heads:
                # squared activations and one squared signal (per token) at the output
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                act_size = math.prod(prog.shapes.get(prog.ops[t.op].ins[1 - t.weight_pos][1], (1,)))
                per_example += out_size + act_size
            elif t is not None and t.squares_factor:
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                act_size = math.prod(prog.shapes.get(prog.ops[t.op].ins[1 - t.weight_pos][1], (1,)))
                per_example += self.G * self.cols * out_size + act_size
            elif t is not None and t.lookup is not None:
                # the signals at the looked-up rows, their per-id sums and squares: no table-sized term
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                per_example += 2 * self.G * self.cols * out_size + self.G * out_size
            else:
                per_example += self.G * self.cols * int(np.prod(w.shape))
        # Per example: the signals and squared gradients counted above, plus the forward
        # intermediates kept for the VJP and one back-propagated signal per column.
        need = (per_example + (1 + self.G * self.cols) * self._activation_elements()) * jnp.dtype(self.dtype).itemsize
        budget_block = self._budget_block(need, "the per-sample GGN signals")
        self.max_block = int(settings["chunk_size"] or budget_block or max(1, _GGN_BUDGET // max(per_example, 1)))

    def begin(self, ws, others, mesh, *, seed, stream, weights=None) -> Run:
        run = super().begin(ws, others, mesh, seed=seed, stream=stream, weights=weights)
        run.extras["seed"], run.extras["stream"] = seed, stream
        return run

    def _group_sum(self, v):
        return v.reshape((self.G, self.cols) + v.shape[1:]).sum(axis=1)

    def _per_example(self, ws, others, xl, u, counted=None):
        prog, taps, gen = self.prog, self.taps, self.gen
        eps0 = {t.op: jnp.zeros(prog.shapes[prog.ops[t.op].outs[0]], self.dtype) for t in taps.values()}

        def fwd(eps, wg):
            w_all = list(ws)
            for k, w in zip(gen, wg):
                w_all[k] = w
            rec: dict = {}
            (z,) = prog.run(w_all, others, xl, eps, rec, fast_pool=True)
            return z, rec

        z, vjp_fn, rec = jax.vjp(fwd, eps0, [ws[k] for k in gen], has_aux=True)
        uniforms = u[None] if self.draws else None
        if counted is None:
            sig = output_signals(jnp, z[None], self.options, uniforms)  # (K', M, 1, C)
        else:  # (K', M·T, 1, T, C): the signals of each counted token, placed at that token
            sig = token_signals(jnp, z[None], self.options, counted[None], uniforms)
        cols = sig.reshape((self.G * self.cols,) + z.shape)
        d_eps, d_wg = jax.vmap(vjp_fn)(cols)
        out = {}
        for j, k in enumerate(gen):
            out[k] = self._group_sum(d_wg[j] ** 2)
        root = self._head_signal(z, counted) if self.heads else None
        for k, t in taps.items():
            a, d = rec[t.op], d_eps[t.op]
            if k in self.heads:
                # The sampled signals reached this tap in the same VJP at no extra cost; they are
                # replaced by the one signal whose square is the logit-Hessian diagonal.
                a, d = _balance(a, prog.head_pullback(t)(root))
                out[k] = (a * a, d * d)  # (1, *out): the shared group only
            elif t.lookup is not None:
                out[k] = self._lookup_squares(t, a, d)
            elif t.squares_factor:
                a, d = _balance(a, d)
                out[k] = (a * a, self._group_sum(d * d))
            elif self._conv_patches_ok(t, a):
                out[k] = self._conv_squares(t, a, d, prog.layout_fn(t)(ws[k]).shape)
            else:
                f, wp = prog.tap_fn(t), prog.layout_fn(t)(ws[k])
                _, vjp_w = jax.vjp(lambda w_: f(a, w_), wp)
                grads = jax.vmap(lambda dd: vjp_w(dd)[0])(d)
                out[k] = self._group_sum(grads**2)
        return out, z

    def _head_signal(self, z, counted=None):
        """``(1, *z.shape)``: each token's (or the sample's) √diag of the logit Hessian, 0 where not counted.

        Unlike :func:`~normflat.engine.losses.token_signals` the tokens share one
        column: a head's output at token ``t`` depends on its input at ``t`` only,
        so its gradient squares summed over per-token signals are the tap's own
        contraction of the squared inputs with these squared signals.
        """
        c = int(z.shape[-1])
        root = diagonal_signals(jnp, z.reshape(-1, c), self.options)[0, 0]  # group 0: (rows, C)
        if counted is not None:
            root = root * counted[:, None]
        return root.reshape((1,) + z.shape)

    def _lookup_squares(self, t, index_args, d):
        """One example's squared table gradients of a lookup tap, per looked-up row (method §3, Embeddings).

        The example's gradient of table row ``v`` for signal ``j`` is the sum of the
        output signals ``d_j`` over the slices that read row ``v``. The rows are
        sorted to number the distinct ids, the signals of each id summed (a segment
        sum, so memory stays ``O(positions)`` however large the vocabulary), squared
        and summed over the signals of each estimate group.

        Returns:
            ``(rows, squares)``: ``(P,)`` int32 table rows (the vocabulary size where a
            slot holds no row) and their ``(G, P, features)`` squares.
        """
        lk = t.lookup
        vocab = self.prog.shapes[self.prog.ops[t.op].ins[0][1]][lk.row_axis]
        rows = self.prog.lookup_rows(t, index_args).reshape(-1)
        rows = jnp.where(rows < 0, vocab, rows)  # dropped lookups (out of range, fill mode): no row
        npos = rows.shape[0]
        sig = jnp.moveaxis(d, 1 + lk.out_feature_axis, -1).reshape(d.shape[0], npos, -1)  # (cols, P, d)
        order = jnp.argsort(rows)
        sorted_rows = rows[order]
        first = jnp.concatenate([jnp.ones((min(npos, 1),), bool), sorted_rows[1:] != sorted_rows[:-1]])
        segment = jnp.cumsum(first) - 1  # the distinct id of each sorted position
        # each position's distinct id in the original order: the signals are summed where they lie
        position_segment = jnp.zeros((npos,), segment.dtype).at[order].set(segment)
        sums = jax.ops.segment_sum(jnp.swapaxes(sig, 0, 1), position_segment,
                                   num_segments=npos)  # (P, cols, d): one row per distinct id
        squares = (sums * sums).reshape(npos, self.G, self.cols, -1).sum(axis=2)
        seg_rows = jnp.full((npos,), vocab, jnp.int32).at[jnp.where(first, segment, npos)].set(
            sorted_rows, mode="drop")
        return seg_rows, jnp.swapaxes(squares, 0, 1)

    def _scatter_lookup(self, t, rows, squares, mask, wp_shape):
        """Sum the examples' per-row squares into the table, in the layout the lookup reads."""
        lk = t.lookup
        vocab, feat = wp_shape[lk.row_axis], wp_shape[lk.feature_axis]
        squares = squares * mask.reshape((-1,) + (1,) * (squares.ndim - 1))  # (n, G, P, d)
        vals = jnp.swapaxes(squares, 0, 1).reshape(self.G, -1, feat)
        table = jnp.zeros((self.G, vocab, feat), squares.dtype).at[:, rows.reshape(-1)].add(vals, mode="drop")
        return table if lk.row_axis == 0 else jnp.swapaxes(table, 1, 2)

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
        sq = (grads * grads).reshape(g, self.G, self.cols, out_ch // g, -1).sum(axis=2)
        sq = jnp.swapaxes(sq, 0, 1).reshape((self.G, out_ch, in_g, *ks))
        inv = [int(i) for i in np.argsort(dn.rhs_spec)]
        return jnp.transpose(sq, (0,) + tuple(1 + i for i in inv))

    def _chunk(self, ws, others, xl, mask, u, counted=None):
        if counted is None:
            outs, z = jax.vmap(self._per_example, in_axes=(None, None, 0, 0))(ws, others, xl, u)
        else:
            outs, z = jax.vmap(self._per_example, in_axes=(None, None, 0, 0, 0))(ws, others, xl, u, counted)

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
            if t.lookup is not None:
                rows, squares = outs[k]
                dwp = self._scatter_lookup(t, rows, squares, mask, wp.shape)
            elif t.squares_factor or k in self.heads:
                a2, d2 = outs[k]
                a2 = a2 * mask.reshape((-1,) + (1,) * (a2.ndim - 1))
                f = self.prog.tap_fn(t)
                # sum_n,c (delta_nc^2)(a_n^2)^T: the tap's own weight VJP applied to squares.
                _, vjp_sq = jax.vjp(lambda w_: jax.vmap(lambda a: f(a, w_))(a2), wp)
                dwp = jax.vmap(lambda d: vjp_sq(d)[0], in_axes=1)(d2)
                if k in self.heads and self.G > 1:
                    # a head's curvature is exact: all of it in the shared group 0, none sampled
                    dwp = jnp.concatenate([dwp, jnp.zeros((self.G - 1,) + dwp.shape[1:], dwp.dtype)])
            else:
                dwp = masked_sum(outs[k])
            _, vjp_layout = jax.vjp(layout, w)
            res.append(jax.vmap(lambda v: vjp_layout(v)[0])(dwp))
        # Padded rows repeat a real example: they change no logit statistic.
        return res, self.stats(z)

    def _uniforms(self, run: Run, offset: int, start: int, length: int, block: int):
        """The piece's ``(block, draws·T)`` uniforms (rows past ``length`` are padding, zeros)."""
        if not self.draws:
            u = run.extras.get(("u0", block))
            if u is None:
                u = run.extras[("u0", block)] = jnp.zeros((block, 1), self.dtype)
            return u
        # Token logits: S draws per token, token t taking columns t·S .. (t+1)·S - 1 (engine.losses).
        n_u = self.draws * self.T
        u = sample_uniforms(run.extras["seed"], run.extras["stream"], offset + start, length, n_u)
        if length < block:
            u = np.concatenate([u, np.zeros((block - length, n_u))])
        return jnp.asarray(u, dtype=self.dtype)

    def run_piece(self, run: Run, piece, offset: int):
        # The GGN does not depend on the labels (a callable loss is refused by the engine); for token
        # logits the session passes the (n, T) counted-token mask in their place.
        xp, counted, mask, start, length, sharded = piece
        u = self._uniforms(run, offset, start, length, int(mask.shape[0]))
        if sharded:
            u = run.shard([u])[0]
        args = [run.ws, run.others, xp, mask, u]
        if self.tokens is not None:
            args.append(counted)
        vals, stats = self.call(run, args, sharded)
        return vals, stats, sharded
