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
options.signals_per_group(C)`` signals each, zero padding included); the padding of
the groups shorter than ``M`` is never back-propagated
(:func:`~normflat.engine.losses.real_signals`). One VJP per real signal gives the
signals at every tap and the per-example gradients of the other weights at once. Taps then
form the per-example squares from their inputs: a dense layer as one contraction
of squared inputs with squared signals, a convolution from per-example gradients
of that layer only (input patches and one batched matmul), an embedding lookup
as a scatter of squared output signals (:meth:`GGN._lookup_squares`: per example
the signals of equal ids are summed, then squared and added into their table
rows; never a ``(n, V, d)`` array), a table added to the activations (a learned
position table, method §6.1 "Position tables") from the signal at its operand of
the addition: per example that *is* the gradient of the rows it reads, pulled back
through the broadcasts on the way (summed per example) before the squares and
through the slices and layout ops after them (:meth:`GGN._table_squares`). A tied
table (row lookups and ``dot_general`` products with the activations, the
:attr:`~normflat.backends.jax.program.Tap.tied` taps: a language model's head tied
to its token embedding) sums its uses' per-example gradients (each one's VJP of the
signal at its output) before squaring, a chunk of examples and of signals at a
time, so that no ``examples × vocabulary × features × signals`` array is formed
(:meth:`GGN._tied_squares`, method §6.1 "Tied weights"); it is never a head.

With ``ggn-topk``, and with ``ggn`` above :data:`STRUCTURED_HEAD_CLASSES` classes,
a dense *head* tap (a layer whose output is the logits,
:attr:`~normflat.backends.jax.program.Tap.head`) takes its squares from the
engine's :func:`~normflat.engine.losses.diagonal_signals` instead: one signal per
sample (per token), whose square is the logit-Hessian diagonal, which gives that
layer its exact GGN diagonal in the shared group 0, returned as that one sum (the
state keeps an exact layer's only sum, ``SumState.add_exact``; no zero sums of the
sampled groups), as the torch and Keras backends do (method §6.1–6.2). For ``(n, C)`` logits the
other layers' signals then start at the head's *input*: the engine's
:class:`~normflat.engine.losses.Factor` pulls the estimator's signals back through
the head in structured form (one row of the head's weight per signal and one
product per shared vector, ``O(C·d)`` per example instead of the ``O(C²·d)`` of
pushing ``C − 1`` dense signals through it), and the VJP runs from the head's input
(:class:`_StructuredHead`). Per-sequence signals of token logits (``ggn-topk``, method
§6.3) do too: at each token a sequence's signal is that token's signed class signal
(:func:`~normflat.engine.losses.sequence_factor`, a factor over the ``T`` token rows),
``O(d)`` per signal and token through a head applied token by token. Per token the
signals stay at the logits.

Token logits ``(n, T, C)`` (method §6.3): the exact ``ggn`` (or
``sequence_signals=False``) back-propagates every (token, signal) pair, ``M·T``
signals per group and sequence; ``ggn-mc`` and ``ggn-topk`` back-propagate per-sequence
signals (:func:`~normflat.engine.losses.token_signals`: each token's signal times an
independent sign, summed over the sequence), ``options.token_signals_per_group(C, T)``
per group and sequence whatever ``T``. The shared group 0 of per-sequence ``ggn-topk`` is
all zeros (:func:`~normflat.engine.losses.zero_signals`): it is not back-propagated, and
every layer but a dense head (whose exact diagonal fills group 0, per token as before)
gets zeros there.

When one example's signals alone exceed the memory (the exact ``ggn`` of a large model
with many classes), the example's ``bp·cols`` signals go a step at a time through one
forward: a ``lax.scan`` over steps of the VJP, each step's squares added into the group
sums by group (:meth:`GGN._per_example`, :meth:`GGN.signal_step_for`; method §9
"Memory"). The step is a static argument of the compiled chunk, chosen per run
(:meth:`GGN.variant`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax.compat import x64_enabled
from normflat.backends.jax.kernel import Kernel, Run
from normflat.core.memory import chunk_size_for, default_budget, equal_step, training_step_bytes
from normflat.engine import native
from normflat.engine.estimators import mean_weights
from normflat.engine.losses import (Factor, diagonal_signals, output_factor, output_signals, real_signals,
                                    sequence_classes, sequence_dense, sequence_factor, token_signals, zero_signals)
from normflat.engine.random import sample_uniforms

__all__ = ["GGN", "STRUCTURED_HEAD_CLASSES"]

#: Elements of per-example intermediate results one vectorised GGN chunk may hold (an upper
#: bound on the chunk whatever the memory budget, :meth:`GGN.block_for`).
_GGN_BUDGET = 2**26
#: Elements of one example's gradients of a tied table formed at once (:meth:`GGN._tied_squares`):
#: as many signals per step as fit, at least one, so that a vocabulary-sized table takes one
#: signal at a time and a small one all of them in a single step.
_TIED_ELEMENTS = 2**20
#: ``ggn`` squares a dense head from the logit-Hessian diagonal and starts the other layers'
#: signals at its input (structured, method §6.1) above this many classes; below, pushing the
#: ``C − 1`` dense signals through the head costs less than forming the structured ones (the
#: torch backend's threshold). ``ggn-topk`` always does (its head must be exact).
STRUCTURED_HEAD_CLASSES = 32


class _Namespace:
    """``jax.numpy`` for the engine's :class:`~normflat.engine.losses.Factor`, whose row indices
    are ``int64``: with x64 off JAX holds ``int32`` only (and warns on every request)."""

    def __getattr__(self, name):
        if name == "int64" and not x64_enabled():
            return jnp.int32
        return getattr(jnp, name)


_XP = _Namespace()


class _StructuredHead:
    """A dense head ``z = P(W a) + b`` seen as a ``(C, D)`` matrix, for :meth:`Factor.through`.

    ``W a`` is the head's ``dot_general`` without batch axes; every entry of its output is
    one row of the weight operand (flattened as ``(free axes of the weight, contracted
    axes)``) applied at one position of the activation (its free axes). ``P`` (the ops from
    the tap to the logits: bias additions, casts, layout ops) only permutes entries: for
    ``(C,)`` logits the activation has no free positions of size > 1; for ``(T, C)`` token
    logits its positions are the tokens and the weight's free axis the classes
    (:func:`~normflat.backends.jax.program._dense_head`), so output entry ``(i, j)`` becomes
    logit ``(token[i], class[j])`` and the signal at position ``i`` of the activation is
    ``Wᵀ`` of token ``token[i]``'s signal.
    """

    def __init__(self, prog, tap):
        op = prog.ops[tap.op]
        (lc, rc), _ = op.params["dimension_numbers"]
        self.wc = tuple(int(j) for j in (lc, rc)[tap.weight_pos])
        self.ac = tuple(int(j) for j in (lc, rc)[1 - tap.weight_pos])
        self.a_shape = tuple(prog.shapes[op.ins[1 - tap.weight_pos][1]])
        free = tuple(j for j in range(len(self.a_shape)) if j not in self.ac)
        self.positions = math.prod(self.a_shape[j] for j in free)
        self.a_order = free + self.ac
        self.a_inverse = tuple(int(j) for j in np.argsort(self.a_order))
        out = prog.out_refs[0][1]
        logits = tuple(prog.shapes[out])
        width = int(logits[-1])  # classes
        # Push the logit numbers back to the tap output: entry o of the output becomes logit pi[o].
        numbers = np.arange(math.prod(logits), dtype=np.int32).reshape((1,) + logits)
        labels = prog.head_pullback(tap, cast=False)(numbers)
        pi = np.asarray(labels, dtype=np.int64).reshape(-1)
        # dot_general's output: the activation's free axes first if it is the left operand.
        pi = pi.reshape(self.positions, -1) if tap.weight_pos == 1 else pi.reshape(-1, self.positions).T
        token, cls = pi[:, 0] // width, pi[0] % width
        #: Whether output entry (i, j) is logit (token[i], class[j]) for every i, j (program._dense_head
        #: makes it so; otherwise the dense signals at the logits are used).
        self.valid = bool(np.array_equal(pi, token[:, None] * width + cls[None, :]))
        self.perm = np.argsort(cls)  # row c of the matrix: the weight row of class c
        self.identity = bool(np.array_equal(self.perm, np.arange(self.perm.size)))
        #: The token (logit row) of each position of the activation, in its free axes' order (None:
        #: in the tokens' order already, the rule).
        self.token = None if np.array_equal(token, np.arange(token.size)) else token

    def matrix(self, wp):
        """``(C, D)``: row ``c`` is the head's weight row of logit ``c`` (``∂z_c / ∂a``, flattened)."""
        free = [j for j in range(wp.ndim) if j not in self.wc]
        d = math.prod(wp.shape[j] for j in self.wc)
        rows = jnp.transpose(wp, free + list(self.wc)).reshape(-1, d)
        return rows if self.identity else rows[self.perm]

    def to_activation(self, sig):
        """``(cols, rows, D)`` signals at the flattened activation, one row per token of the logits
        (one for ``(C,)`` logits) -> ``(cols, *a_shape)``."""
        if self.token is not None:
            sig = jnp.take(sig, jnp.asarray(self.token), axis=1)  # (cols, positions, D)
        shape = tuple(self.a_shape[j] for j in self.a_order)
        sig = sig.reshape((sig.shape[0],) + shape)
        return jnp.transpose(sig, (0,) + tuple(1 + j for j in self.a_inverse))


def _balance(a, d):
    """``(a·t, d/t)`` with ``t`` a power of 2 that gives both the same magnitude (per example).

    The dense path squares the activation and the signals separately; their product is
    a squared gradient entry, but each factor alone can leave the float32 range (logits
    near 1e20 give signals near 1e-20, whose squares underflow). Scaling by a power of
    2 is exact, so the product is unchanged.
    """
    t = _balance_scale(a, d)
    return a * t, d / t


def _balance_scale(a, d):
    """The power of 2 ``t`` of :func:`_balance`."""
    ma, md = jnp.max(jnp.abs(a)), jnp.max(jnp.abs(d))
    ok = (ma > 0) & (md > 0) & jnp.isfinite(ma) & jnp.isfinite(md)
    e = jnp.round(0.5 * (jnp.log2(jnp.where(ok, md, 1)) - jnp.log2(jnp.where(ok, ma, 1))))
    return jnp.exp2(e).astype(a.dtype)


def _params_key(params: dict) -> str:
    """A comparable text of a primitive's parameters (equal for the same product written out twice)."""
    return repr(sorted((name, repr(value)) for name, value in params.items()))


def _only_through_input(prog, tap) -> bool:
    """Whether the logits depend on the weights only through the head's activation operand.

    True for a head ``dot_general`` without batch axes whose way to the logits
    (:attr:`~normflat.backends.jax.program.Tap.head`) adds no term computed from a
    weight: then the signals at the head's input carry every other weight's GGN.
    """
    op = prog.ops[tap.op]
    (_, _), (lb, rb) = op.params["dimension_numbers"]
    if len(lb) or len(rb) or op.ins[1 - tap.weight_pos][0] != "ref" or tap.head is None:
        return False
    dependent = set(prog.weight_refs)
    for o in prog.ops:
        if any(a[0] == "ref" and a[1] in dependent for a in o.ins):
            dependent.update(o.outs)
    ref = op.outs[0]
    for i in tap.head:
        o = prog.ops[i]
        if any(a[0] == "ref" and a[1] in dependent and a[1] != ref for a in o.ins):
            return False
        ref = o.outs[0]
    return True


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
        #: options.pooled: the weights of the K' sums in their mean, which :meth:`_chunk` returns alone.
        self.pool = mean_weights(options) if options.pooled else None
        self.M = options.signals_per_group(num_classes)
        # fast=False: no taps, every weight on the generic path (cross-checks, as in torch and Keras).
        taps = self.active_taps = prog.taps if settings["fast"] else []
        self.taps = {t.weight: t for t in taps if not t.tied}
        #: Tied tables (method §6.1 "Tied weights"): weight -> its taps, one per use.
        self.tied: dict[int, list] = {}
        for t in taps:
            if t.tied:
                self.tied.setdefault(t.weight, []).append(t)
        self.gen = [k for k in range(len(ws)) if k not in self.taps and k not in self.tied]
        super().__init__(options, prog, ws, dtype, num_classes, settings)
        # Dense heads get the exact diagonal from one signal (program.Tap.head): ggn-topk always,
        # ggn above STRUCTURED_HEAD_CLASSES classes with (n, C) logits (method §6.1).
        heads = {k for k, t in self.taps.items() if t.head is not None}
        if options.estimator == "ggn":
            wanted = self.tokens is None and num_classes > STRUCTURED_HEAD_CLASSES
        else:
            wanted = options.estimator == "ggn-topk"
        self.heads = heads if wanted else set()
        # (n, C) logits, and token logits per sequence: the other layers' signals start at the
        # head's input (structured).
        self.structured = None
        if self.heads and (self.tokens is None or options.sequence_layout(self.tokens)) and len(self.heads) == 1:
            k = next(iter(self.heads))
            if _only_through_input(prog, self.taps[k]):
                head = _StructuredHead(prog, self.taps[k])
                self.structured = (k, head) if head.valid else None
        # Token logits (method §6.3): per token every (token, signal) pair is its own back-propagated
        # signal (M·T per group), per sequence M' signed sums over the tokens; the counted-token mask of
        # the piece is one more batch input (not a Python branch).
        self.cols = self.M if self.tokens is None else options.token_signals_per_group(num_classes, self.tokens)
        # Leading groups whose signals are all zero (per-sequence ggn-topk's group 0): not
        # back-propagated; those layers' sums get zeros there (_pad_groups).
        zero = set(zero_signals(options, self.cols, sequence=options.sequence_layout(self.tokens)))
        assert zero == set(range(len(zero))) and len(zero) % self.cols == 0
        self.skip = len(zero) // self.cols
        self.bp = self.G - self.skip  # groups back-propagated
        # The real signals of those groups (flat g·cols + member after the skipped groups): a group
        # shorter than M (ggn-topk's exact classes against its draws per group, draws that do not
        # divide into K groups) is padded with zero signals, never back-propagated
        # (losses.real_signals). None: every one is real, and the groups are contiguous runs.
        sequence = options.sequence_layout(self.tokens)
        live = real_signals(options, num_classes, sequence=sequence,
                            tokens=1 if self.tokens is None or sequence else self.tokens) - self.skip * self.cols
        assert live.size and live[0] >= 0  # the skipped groups hold no real signal
        #: Back-propagated signals per example.
        self.total = int(live.size)
        self.real = None if self.total == self.bp * self.cols else live.astype(np.int32)
        if self.tokens is not None:
            self.batch_args = (2, 3, 4, 5)
        self.paths = ["generic" if k in self.gen else "fast" for k in range(len(ws))]
        #: Why each weight without a tap takes the generic path (None for the fast ones).
        self.reasons = [None if k not in self.gen else prog.reasons[k] if settings["fast"] else "fast=False"
                        for k in range(len(ws))]
        #: Per tied table, the signals whose per-example gradients one step of
        #: :meth:`_tied_squares` forms at once: at most what fits :data:`_TIED_ELEMENTS`, in
        #: equal steps (20 signals in steps of at most 16 go as 10 + 10, not 16 + 16 padded).
        self.tied_step = {}
        for k in self.tied:
            most = min(self.total, max(1, _TIED_ELEMENTS // max(1, int(np.prod(ws[k].shape)))))
            self.tied_step[k] = equal_step(self.total, most)
        # Per example, in elements: ``base`` whatever the signals, ``per_signal`` for each
        # back-propagated signal (bp·cols of them at once, or a step of them), ``sums`` the
        # group sums a step of signals adds into, ``tied_steps`` the tied tables' own steps
        # (all signals at once) and ``tied_tables`` their per-signal gradients (in steps).
        base = per_signal = sums = tied_tables = tied_steps = 0
        for k, w in enumerate(ws):
            t = self.taps.get(k)
            size = int(np.prod(w.shape))
            if k in self.tied:
                # the signals at every use's output (and its activation), then one step's per-example
                # gradients of the whole table and their squares
                for u in self.tied[k]:
                    out_size = math.prod(prog.shapes[prog.ops[u.op].outs[0]])
                    act_size = math.prod(prog.shapes.get(prog.ops[u.op].ins[1 - u.weight_pos][1], (1,)))
                    per_signal += out_size
                    base += act_size
                tied_steps += 2 * self.tied_step[k] * size
                tied_tables += size
                sums += self.bp * size
            elif k in self.heads:
                # squared activations and one squared signal (per token) at the output
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                act_size = math.prod(prog.shapes.get(prog.ops[t.op].ins[1 - t.weight_pos][1], (1,)))
                base += out_size + act_size
            elif t is not None and t.squares_factor:
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                act_size = math.prod(prog.shapes.get(prog.ops[t.op].ins[1 - t.weight_pos][1], (1,)))
                per_signal += out_size
                base += act_size
                sums += self.bp * out_size
            elif t is not None and t.lookup is not None:
                # the signals at the looked-up rows, their per-id sums and squares: no table-sized term
                out_size = math.prod(prog.shapes[prog.ops[t.op].outs[0]])
                per_signal += 2 * out_size
                base += self.bp * out_size
            elif t is not None and t.added is not None:
                # the signals at the table's operand, pulled back to the rows read, and their squares
                operand = math.prod(prog.shapes[prog.ops[t.op].ins[t.weight_pos][1]])
                rows = math.prod(prog.table_spread(t)[1])
                per_signal += operand + rows
                base += self.bp * rows
            else:
                per_signal += size
                sums += self.bp * size
        signals = self.total
        per_example = base + tied_steps + signals * per_signal
        # Per example: the signals and squared gradients counted above, plus the forward
        # intermediates kept for the VJP and one back-propagated signal per column.
        activations = self._activation_elements()
        item = jnp.dtype(self.dtype).itemsize
        self.need = (per_example + (1 + signals) * activations) * item
        # Bytes of one example whose signals go ``s`` at a time, ``_step_base + s · _step_signal``
        # (:meth:`signal_step_for`): also the group sums they add into, and a tied table's
        # per-signal gradients instead of its own steps. A step's signals at the logits are formed
        # as it comes (of (n, C) logits and token logits alike), within a signal's activations.
        self._step_base = (base + sums + activations) * item
        self._step_signal = (per_signal + 2 * tied_tables + activations) * item
        #: Signals of one example back-propagated at once when they do not all fit (None: all of them).
        self.signal_step = None
        budget = settings["memory_budget"]
        if settings["chunk_size"] or budget is None or self.need <= budget:
            budget_block = self._budget_block(self.need, "the per-sample GGN signals")
        else:
            # One example at a time, its signals in steps (as the torch and Keras backends): an
            # error only if one signal does not fit.
            self.signal_step = self.signal_step_for(budget, refuse=True)
            budget_block = 1
        self.max_block = int(settings["chunk_size"] or budget_block or max(1, _GGN_BUDGET // max(per_example, 1)))
        # The layer outputs of one example (every op that uses a weight, and the logits): the
        # activations of a training step (the default budget, block_for).
        used = {id(op): op for uses in prog.uses for op, _, _ in uses}
        out = prog.out_refs[0] if len(prog.out_refs) == 1 else None
        self.layer_outputs = sum(math.prod(prog.shapes.get(r, ())) for op in used.values() for r in op.outs) + (
            math.prod(prog.shapes.get(out[1], ())) if out is not None and out[0] == "ref" else 0)
        self.weight_entries = sum(self.sizes)

    def block_for(self, run: Run, n: int) -> int:
        """Examples per device and compiled call for a first batch of ``n`` examples per device.

        ``chunk_size`` or ``memory_budget`` given: :attr:`max_block`. Neither: the working
        memory stays within about twice a training step of the model on the batch
        (:func:`normflat.core.memory.default_budget` of
        :func:`~normflat.core.memory.training_step_bytes` of all parameters and the layer
        outputs of the batch, less the sums the state keeps of every analyzed weight (``K'``, or
        one pooled); at least :data:`~normflat.core.memory.DEFAULT_BUDGET_FLOOR`), the torch
        backend's rule, and
        never more than the :data:`_GGN_BUDGET` bound on the intermediates.
        """
        if self.settings.get("chunk_size") or self.settings.get("memory_budget") is not None:
            return self.max_block
        item = jnp.dtype(self.dtype).itemsize
        params = sum(int(np.prod(a.shape, dtype=np.int64)) for a in list(run.ws) + list(run.others)
                     if hasattr(a, "shape") and hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact))
        step = training_step_bytes(params, self.layer_outputs * int(n), item)
        state = self.options.sum_groups * self.weight_entries * item
        budget = default_budget(step, state)
        by_memory = budget // max(int(self.need), 1)
        if by_memory < 1:
            # One example's signals alone exceed the budget (the exact ggn of a large model with
            # many classes): one example at a time, its signals in steps, so that the peak stays
            # bounded whatever the number of classes.
            run.extras["signal_step"] = self.signal_step_for(budget)
        return max(1, min(int(by_memory), self.max_block))

    def signal_step_for(self, budget: int, refuse: bool = False) -> int | None:
        """Signals of one example back-propagated at once within ``budget`` bytes, in equal steps
        (None: all of them fit). ``refuse``: a budget that one signal does not fit is an error
        (the user's ``memory_budget``); otherwise one signal at a time."""
        if refuse:
            chunk_size_for(budget, self._step_base + self._step_signal, "one back-propagated GGN signal")
        total = self.total
        most = max(1, (int(budget) - self._step_base) // self._step_signal)
        if most >= total:
            return None
        return equal_step(total, most)

    def variant(self, run: Run) -> dict:
        """The signal step of this run, if any, is compiled into the chunk (:meth:`_chunk`)."""
        step = run.extras.get("signal_step", self.signal_step)
        return {} if step is None else {"step": int(step)}

    def begin(self, ws, others, mesh, *, seed, stream, weights=None) -> Run:
        run = super().begin(ws, others, mesh, seed=seed, stream=stream, weights=weights)
        run.extras["seed"], run.extras["stream"] = seed, stream
        return run

    def _group_sum(self, v, groups=None):
        """Squares of back-propagated signals ``(signals, ...)`` -> their ``(bp, ...)`` group sums.

        ``groups`` None: all ``bp·cols`` signals, in order. Otherwise the group of each
        (:meth:`_groups_of`: a numpy array for the real signals of a padded layout, a traced one
        for a step of them, :meth:`_per_example`; a step's padding is zero).

        Known groups are summed by a contraction with their constant ``(bp, signals)``
        membership matrix, not by a sum over the signals' axis: under the ``vmap`` over a
        chunk's examples that axis is an inner one, and XLA's CPU reduction over an inner axis
        of ``(examples, signals, entries)`` ran 6–8× slower than the matrix product (3C3D's
        ``ggn``: 0.92 s against 0.43 s, method §6.1). A step's groups (one example at a time,
        the signals' axis leading) are added by a segment sum.
        """
        if groups is None:
            groups = np.arange(v.shape[0]) // self.cols
        if isinstance(groups, np.ndarray):
            member = groups[None, :] == np.arange(self.bp)[:, None]
            return jnp.tensordot(jnp.asarray(member, v.dtype), v, axes=1, precision=jax.lax.Precision.HIGHEST)
        return jax.ops.segment_sum(v, groups, num_segments=self.bp)

    def _real_index(self, index):
        """Flat positions ``g·cols + member`` of the back-propagated signals numbered ``index``
        (``0 .. total − 1``; clipped: the caller masks those past the end)."""
        index = jnp.minimum(index, self.total - 1)
        return index if self.real is None else jnp.take(jnp.asarray(self.real), index)

    def _groups_of(self, flat=None):
        """The group of each signal at the flat positions ``flat`` (``None``: every real signal, a
        numpy array; then ``None`` where they are all of them, in order)."""
        if flat is None:
            return None if self.real is None else self.real // self.cols
        return jnp.minimum(flat // self.cols, self.bp - 1)

    def _pad_groups(self, v):
        """``(bp, ...)`` group sums -> ``(G, ...)``: zeros for the groups not back-propagated."""
        if not self.skip:
            return v
        return jnp.concatenate([jnp.zeros((self.skip,) + v.shape[1:], v.dtype), v])

    def _per_example(self, ws, others, xl, u, counted=None, step=None):
        """One example's squares: per weight its ``(bp, ...)`` group sums, or what :meth:`_chunk`
        finishes over the examples (a head's or dense tap's squared factors, a lookup's rows, a tied
        table's signals).

        ``step``: the example's ``bp·cols`` signals are back-propagated ``step`` at a time (a
        ``lax.scan``; the forward once), their squares added into the group sums, so that one
        example's memory is bounded however many signals it has (:meth:`signal_step_for`); the
        signals of a step are formed as it comes (of ``(n, C)`` logits and per token from the
        factor, never all ``C − 1`` at once; per sequence from the tokens' classes and scales).
        """
        prog, taps, gen = self.prog, self.taps, self.gen
        # An added table is perturbed at its operand of the addition (Program.run), the others at their output.
        eps0 = {t.op: jnp.zeros(prog.shapes[prog.ops[t.op].ins[t.weight_pos][1] if t.added is not None
                                            else prog.ops[t.op].outs[0]], self.dtype) for t in self.active_taps}

        def fwd(eps, wg):
            w_all = list(ws)
            for k, w in zip(gen, wg):
                w_all[k] = w
            rec: dict = {}
            (z,) = prog.run(w_all, others, xl, eps, rec, fast_pool=True)
            return z, rec

        uniforms = u[None] if self.draws else None
        total = self.total
        if self.structured is not None:
            # The signals start at the head's input, pulled back through the head in structured
            # form (losses.Factor): O(C·d) per example, not O(C²·d). Every other weight reaches
            # the logits through that input only (_only_through_input).
            hk, head = self.structured
            hop = taps[hk].op

            def fwd_input(eps, wg):
                z, rec = fwd(eps, wg)
                return rec[hop], (z, rec)

            pulled, vjp_fn, (z, rec) = jax.vjp(fwd_input, eps0, [ws[k] for k in gen], has_aux=True)
            if counted is None:
                factor = output_factor(_XP, z.reshape(1, -1), self.options, uniforms)
            else:
                # Per sequence: each token's signed class signal, over the T token rows
                # (losses.sequence_factor), O(d) per signal and token through the head.
                factor = sequence_factor(_XP, z[None], self.options, counted[None], uniforms)
            matrix = head.matrix(prog.layout_fn(taps[hk])(ws[hk]))
            projected = factor.projected(_XP, matrix)  # once, not per step

            def signals(columns=None):
                if columns is None:
                    part = self._live(factor)
                    if self.real is not None:  # the real signals only, before they go through the head
                        part = self._factor_columns(factor, jnp.asarray(self.real), jnp.ones(self.total, bool),
                                                    rows=int(factor.index.shape[-1]))
                else:
                    part = self._factor_columns(factor, *columns, rows=int(factor.index.shape[-1]))
                through = part.through(_XP, matrix, projected)  # (bp, cols, rows, D), or (1, step, rows, D)
                return head.to_activation(through.reshape((-1,) + through.shape[2:]))
        else:
            z, vjp_fn, rec = jax.vjp(fwd, eps0, [ws[k] for k in gen], has_aux=True)
            pulled = z
            if counted is None and step is not None:
                factor = output_factor(_XP, z[None], self.options, uniforms)

                def signals(columns=None):
                    return self._factor_columns(factor, *columns).dense(_XP).reshape((-1,) + z.shape)
            elif step is not None and not self.options.sequence_layout(self.tokens):
                # Per token: each signal is one token's factor signal placed at its token, formed a
                # step at a time from the per-token factor (token_signals' layout, m·T + t).
                per_token = None if uniforms is None else u.reshape(self.tokens, -1)[:, :self.options.draws]
                factor = output_factor(_XP, z, self.options, per_token)  # T rows

                def signals(columns=None):
                    return self._token_columns(factor, counted, *columns)
            elif step is not None and counted is not None:
                # Per sequence: each signal a signed sum over the tokens, formed a step at a time from
                # the per-token classes and scales (losses.sequence_classes), never all at once.
                classes = sequence_classes(jnp, z[None], self.options, counted[None], uniforms)

                def signals(columns=None):
                    return self._sequence_columns(classes, *columns)
            else:
                if counted is None:
                    sig = output_signals(jnp, z[None], self.options, uniforms)  # (K', M, 1, C)
                else:  # (K', M', 1, T, C): per token placed at their token, or per sequence (method §6.3)
                    sig = token_signals(jnp, z[None], self.options, counted[None], uniforms)
                cols = sig[self.skip:].reshape((self.bp * self.cols,) + z.shape)  # the zero groups: no VJP

                def signals(columns=None):
                    if columns is None:
                        return cols if self.real is None else jnp.take(cols, jnp.asarray(self.real), axis=0)
                    index, valid = columns
                    picked = jnp.take(cols, index, axis=0)
                    return jnp.where(valid.reshape((-1,) + (1,) * z.ndim), picked, jnp.zeros_like(picked))
        lookups = {k: self._lookup_segments(t, rec[t.op]) for k, t in taps.items()
                   if t.lookup is not None and k not in self.heads}

        def pull(signal):
            # Logits computed in another dtype than the analysis (a float32 head of a float64 model)
            # take their signals in their own dtype, as the model's own VJP does.
            return vjp_fn(signal.astype(pulled.dtype))

        if step is None:
            d_eps, d_wg = jax.vmap(pull)(signals())
            sums, scales = self._signal_squares(ws, rec, lookups, d_eps, d_wg, self._groups_of())
        else:
            def one_step(i, scales):
                index = i * step + jnp.arange(step)
                valid = index < total
                flat = self._real_index(index)  # the step's signals' positions in the (bp, cols) layout
                d_eps, d_wg = jax.vmap(pull)(signals((flat, valid)))
                return self._signal_squares(ws, rec, lookups, d_eps, d_wg, self._groups_of(flat), scales,
                                            stepped=True)

            # The first step outside the scan: it fixes the dense taps' balancing scales and the
            # sums' shapes; the others add into them.
            sums, scales = one_step(0, None)

            def body(acc, i):
                part, _ = one_step(i, scales)
                return jax.tree_util.tree_map(jnp.add, acc, part), None

            sums, _ = jax.lax.scan(body, sums, jnp.arange(1, -(-total // step)))
        out = dict(sums)
        root = self._head_signal(z, counted) if self.heads else None
        for k, uses in self.tied.items():
            if step is None:
                # Each use's activation (a lookup's ids) and the signals at its output: the per-example
                # gradients are formed and summed over the uses a chunk at a time (_tied_squares).
                out[k] = ([rec[u.op] for u in uses], sums[k])
        for k, t in taps.items():
            a = rec.get(t.op)
            if k in self.heads:
                # The sampled signals reached this tap in the same VJP at no extra cost; they are
                # replaced by the one signal whose square is the logit-Hessian diagonal.
                a, d = _balance(a, prog.head_pullback(t)(root))
                out[k] = (a * a, d * d)  # (1, *out): the shared group only
            elif t.lookup is not None:
                out[k] = (lookups[k][1], sums[k])
            elif t.squares_factor:
                a = a * scales[k]
                out[k] = (a * a, sums[k])
        return out, z

    def _signal_squares(self, ws, rec, lookups, d_eps, d_wg, groups=None, scales=None, stepped=False):
        """The group sums of the squares of some back-propagated signals, per weight.

        ``d_eps``, ``d_wg``: the signals at the taps and the per-signal gradients of the generic
        weights (all real signals, or a ``stepped`` step of them), whose groups are ``groups``
        (:meth:`_group_sum`). A dense tap's sums are of its squared signals (the squared
        activations are the example's, :meth:`_per_example`), balanced by a power of 2
        (:func:`_balance`): ``scales`` given (a step after the first), those of the first step.
        A tied table's, not ``stepped``: its signals at each use, squared in :meth:`_tied_squares`.

        Returns:
            ``(sums, scales)``: per weight index its sums, and the balancing scales used.
        """
        prog, taps = self.prog, self.taps
        sums, used = {}, {}
        for j, k in enumerate(self.gen):
            sums[k] = self._group_sum(d_wg[j] ** 2, groups)
        for k, uses in self.tied.items():
            if not stepped:
                sums[k] = [d_eps[u.op] for u in uses]
            else:  # this example's gradients of the table for the step's signals, summed over the uses
                grads = jax.vmap(self._tied_gradient(k, ws[k]), in_axes=(None, 0))(
                    [rec[u.op] for u in uses], [d_eps[u.op] for u in uses])
                sums[k] = self._group_sum(grads * grads, groups)
        for k, t in taps.items():
            if k in self.heads:
                continue
            a, d = rec.get(t.op), d_eps[t.op]
            if t.added is not None:
                sums[k] = self._table_squares(t, d, groups)
            elif t.lookup is not None:
                sums[k] = self._lookup_squares(lookups[k][0], d, t, groups)
            elif t.squares_factor:
                used[k] = _balance_scale(a, d) if scales is None else scales[k]
                sums[k] = self._group_sum((d / used[k]) ** 2, groups)
            elif self._conv_patches_ok(t, a):
                sums[k] = self._conv_squares(t, a, d, prog.layout_fn(t)(ws[k]).shape, groups)
            else:
                f, wp = prog.tap_fn(t), prog.layout_fn(t)(ws[k])
                _, vjp_w = jax.vjp(lambda w_: f(a, w_), wp)
                grads = jax.vmap(lambda dd: vjp_w(dd)[0])(d)
                sums[k] = self._group_sum(grads**2, groups)
        return sums, used

    def _token_columns(self, factor, counted, index, valid):
        """``(len(index), T, C)``: the per-token signals ``index`` (flat ``group·cols + m·T + t`` of
        the back-propagated groups, :func:`~normflat.engine.losses.token_signals`' per-token layout)
        of one example's per-token :class:`~normflat.engine.losses.Factor` (``T`` rows), each its
        token's signal times whether the token is counted, placed at its token; zero where not
        ``valid``."""
        t = index % self.tokens
        part = self._factor_columns(factor, index, valid)  # (1, s, 1) classes, scales, coefficients
        rows = Factor(part.index.reshape(1, 1, -1), part.scale.reshape(1, 1, -1),
                      [jnp.take(v, t, axis=0) for v in factor.vectors], [w.reshape(1, 1, -1) for w in part.coefs])
        dense = rows.dense(_XP).reshape(index.shape[0], -1) * jnp.take(counted, t)[:, None]  # (s, C)
        place = (jnp.arange(self.tokens)[None, :] == t[:, None]).astype(dense.dtype)  # (s, T)
        return dense[:, None, :] * place[:, :, None]

    def _sequence_columns(self, classes, index, valid):
        """``(len(index), T, C)``: the per-sequence signals ``index`` (flat ``group·cols + member`` of
        the back-propagated groups, :func:`~normflat.engine.losses.token_signals`' per-sequence
        layout) of one example's :class:`~normflat.engine.losses.SequenceClasses`, formed alone
        (``O(T·C)`` each); zero where not ``valid``."""
        def pick(values, fill):
            flat = values[self.skip:].reshape(-1, values.shape[-1])  # (bp·cols, T)
            got = jnp.take(flat, jnp.minimum(index, flat.shape[0] - 1), axis=0)  # (s, T)
            return jnp.where(valid[:, None], got, jnp.full_like(got, fill))[None]

        sig = sequence_dense(jnp, classes, self.options, pick(classes.index, -1), pick(classes.scale, 0))
        return sig.reshape((index.shape[0], self.tokens, -1))  # (1, s, T, C) -> (s, T, C)

    def _factor_columns(self, factor, index, valid, rows=1):
        """The back-propagated signals ``index`` of a one-example :class:`~normflat.engine.losses.Factor`,
        zero where not ``valid``: a ``(1, len(index), rows)`` factor, whose signals cost ``O(C)`` per
        row each.

        ``rows=1``: ``index`` is flat over every entry of the groups after the skipped ones
        (``group·cols + member`` for ``(n, C)`` logits, ``group·cols + m·T + t`` for the per-token
        factor of :meth:`_token_columns`); ``rows=T``: over the signals of the per-sequence factor of
        :func:`~normflat.engine.losses.sequence_factor`, each one row per token.
        """
        live = self._live(factor)

        def pick(values, fill):
            flat = values.reshape(-1, rows)
            got = jnp.take(flat, jnp.minimum(index, flat.shape[0] - 1), axis=0)
            return jnp.where(valid[:, None], got, jnp.full_like(got, fill))[None]

        return Factor(pick(live.index, -1), pick(live.scale, 0), live.vectors, [pick(w, 0) for w in live.coefs])

    def _live(self, factor):
        """A one-example :class:`~normflat.engine.losses.Factor` without its skipped groups (the
        all-zero shared group of per-sequence ``ggn-topk``, never back-propagated), every array of
        the signals' full ``(groups, members, rows)`` shape."""
        def live(values):
            return jnp.broadcast_to(values, factor.index.shape)[self.skip:]

        return Factor(live(factor.index), live(factor.scale), factor.vectors, [live(w) for w in factor.coefs])

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

    def _table_squares(self, t, d, groups=None):
        """One example's ``(bp, *rows)`` squared gradients of a table added to the activations.

        ``d`` ``(cols, *operand)`` are the signals at the table's operand of the addition: the
        program is per example, so they are this example's gradient of that operand. Pulled back
        through the broadcasts and casts on the way (:attr:`~normflat.backends.jax.program.Tap.added`,
        whose VJP sums the entries one table entry became, before the square), they are the
        gradient of the value :attr:`~normflat.backends.jax.program.Tap.chain` makes of the table
        (the rows read); squared and summed over the signals of each group. The slices and layout
        ops of the chain only select entries: :meth:`_chunk` maps the summed squares back through
        them, as for any tap, so nothing table-sized is formed per example and signal.
        """
        if t.added:
            spread, shape, dtype = self.prog.table_spread(t)
            _, pull = jax.vjp(spread, jnp.zeros(shape, dtype or self.dtype))
            d = jax.vmap(lambda v: pull(v)[0])(d)
        return self._group_sum(d * d, groups)

    def _lookup_segments(self, t, index_args):
        """One example's distinct looked-up rows of a lookup tap (method §3, Embeddings).

        The rows are sorted to number the distinct ids, so that the signals of each id can be
        summed (a segment sum, memory ``O(positions)`` however large the vocabulary).

        Returns:
            ``(segment, rows)``: the ``(P,)`` distinct id of each position, and the ``(P,)``
            int32 table row of each distinct id (the vocabulary size where a slot holds no row).
        """
        lk = t.lookup
        vocab = self.prog.shapes[self.prog.ops[t.op].ins[0][1]][lk.row_axis]
        rows = self.prog.lookup_rows(t, index_args).reshape(-1)
        rows = jnp.where(rows < 0, vocab, rows)  # dropped lookups (out of range, fill mode): no row
        npos = rows.shape[0]
        order = jnp.argsort(rows)
        sorted_rows = rows[order]
        first = jnp.concatenate([jnp.ones((min(npos, 1),), bool), sorted_rows[1:] != sorted_rows[:-1]])
        segment = jnp.cumsum(first) - 1  # the distinct id of each sorted position
        # each position's distinct id in the original order: the signals are summed where they lie
        position_segment = jnp.zeros((npos,), segment.dtype).at[order].set(segment)
        seg_rows = jnp.full((npos,), vocab, jnp.int32).at[jnp.where(first, segment, npos)].set(
            sorted_rows, mode="drop")
        return position_segment, seg_rows

    def _lookup_squares(self, segment, d, t, groups=None):
        """One example's ``(bp, P, features)`` squared table gradients of a lookup tap, per distinct id.

        The example's gradient of table row ``v`` for signal ``j`` is the sum of the output
        signals ``d_j`` over the slices that read row ``v`` (``segment``, :meth:`_lookup_segments`):
        summed, squared and summed over the signals of each estimate group (``groups``:
        :meth:`_group_sum`). Never a ``(V, d)`` array.
        """
        npos = segment.shape[0]
        sig = jnp.moveaxis(d, 1 + t.lookup.out_feature_axis, -1).reshape(d.shape[0], npos, -1)  # (cols, P, d)
        sums = jax.ops.segment_sum(jnp.swapaxes(sig, 0, 1), segment, num_segments=npos)  # (P, cols, d)
        return self._group_sum(jnp.swapaxes(sums * sums, 0, 1), groups)

    def _tied_gradient(self, k, w):
        """``gradient(records, signals)``: one example's gradient of the tied table ``w`` (weight ``k``)
        for one signal, the sum over its uses of each use's VJP of the signal at its output.

        Uses that are the same product (the same primitive, parameters and layout chain, records and
        outputs of the same shapes: a layer called in a loop)
        go as one: their records and signals stacked, the VJP of the product mapped over them with
        the weight shared, which sums the uses inside one contraction (one matmul over the steps, the
        dense rule with the steps as positions) instead of forming each use's gradient."""
        prog = self.prog
        groups: dict[Any, list[int]] = {}
        for j, u in enumerate(self.tied[k]):
            op = prog.ops[u.op]
            ops = [op] + [prog.ops[i] for i in u.chain]
            shapes = [prog.shapes.get(r) for o in ops for r in o.outs] + [
                prog.shapes.get(a[1]) if a[0] == "ref" else None for a in op.ins]
            key = None if u.lookup is not None else (
                u.weight_pos, tuple((o.prim.name, _params_key(o.params)) for o in ops), tuple(map(str, shapes)))
            groups.setdefault(key if key is not None else ("use", j), []).append(j)
        fns = [(members, prog.tap_fn(self.tied[k][members[0]]), prog.layout_fn(self.tied[k][members[0]]))
               for members in groups.values()]

        def gradient(recs, sigs):
            g = None
            for members, f, layout in fns:
                if len(members) == 1:
                    r, sig = recs[members[0]], sigs[members[0]]
                    out, pull = jax.vjp(lambda w_, f=f, layout=layout, r=r: f(r, layout(w_)), w)
                else:
                    r = jnp.stack([recs[m] for m in members])
                    sig = jnp.stack([sigs[m] for m in members])
                    out, pull = jax.vjp(lambda w_, f=f, layout=layout, r=r: jax.vmap(lambda a: f(a, layout(w_)))(r),
                                        w)
                # A use computing in another dtype than the analysis (a float32 reverse projection of a
                # float64 table) takes its signals in its own dtype, as its VJP in the model does.
                part = pull(sig.astype(out.dtype))[0]
                g = part if g is None else g + part
            return g

        return gradient

    def _tied_squares(self, k, w, records, signals, mask):
        """``(bp, *w.shape)``: squared per-example gradients of a tied table, summed over the chunk's
        examples and each group's signals (method §6.1 "Tied weights").

        For every example and signal the table's gradient is the sum over its uses
        (:attr:`tied`) of each use's VJP, with respect to the table, of the signal at that
        use's output: a lookup scatters its output signals into the rows it read (its own
        primitive's transpose, so clipped or dropped ids are handled as the model does), a
        ``dot_general`` forms the product of the signal with its activation. The sum is
        squared, weighted by ``mask`` (padded examples) and added into the signal's group.
        The signals go in steps of :attr:`tied_step` (a ``lax.scan``): one step holds
        ``examples × tied_step`` gradients of the table, never those of every signal.

        Args:
            k: The table's weight index.
            w: The table, in the weight's own layout.
            records: Per use, its recorded operand, ``(n, ...)`` (a lookup's index operands).
            signals: Per use, the ``(n, total, *output)`` signals at its output (the real ones).
            mask: ``(n,)`` weights of the examples (0 for padding).
        """
        per_example = jax.vmap(jax.vmap(self._tied_gradient(k, w), in_axes=(None, 0)), in_axes=(0, 0))
        total, step = self.total, self.tied_step[k]
        steps = -(-total // step)
        pad = steps * step - total  # zero signals: zero gradients, added to the last group

        def split(s):  # (n, total, *out) -> (steps, n, step, *out)
            s = jnp.pad(s, [(0, 0), (0, pad)] + [(0, 0)] * (s.ndim - 2))
            return jnp.moveaxis(s.reshape((s.shape[0], steps, step) + s.shape[2:]), 1, 0)

        group = self._groups_of(self._real_index(jnp.arange(steps * step))).reshape(steps, step)

        def body(acc, xs):
            sigs, grp = xs
            g = per_example(records, sigs)  # (n, step, *w)
            return acc.at[grp].add(jnp.tensordot(mask.astype(g.dtype), g * g, axes=1)), None

        acc = jnp.zeros((self.bp,) + tuple(w.shape), w.dtype)
        acc, _ = jax.lax.scan(body, acc, ([split(s) for s in signals], group))
        return acc

    def _scatter_lookup(self, t, rows, squares, mask, wp_shape):
        """Sum the examples' per-row squares into the table, in the layout the lookup reads."""
        lk = t.lookup
        vocab, feat = wp_shape[lk.row_axis], wp_shape[lk.feature_axis]
        squares = squares * mask.reshape((-1,) + (1,) * (squares.ndim - 1))  # (n, bp, P, d)
        vals = jnp.swapaxes(squares, 0, 1).reshape(self.bp, -1, feat)
        table = jnp.zeros((self.bp, vocab, feat), squares.dtype).at[:, rows.reshape(-1)].add(vals, mode="drop")
        return table if lk.row_axis == 0 else jnp.swapaxes(table, 1, 2)

    def _conv_patches_ok(self, t, a) -> bool:
        op = self.prog.ops[t.op]
        prm = op.params
        return (op.prim.name == "conv_general_dilated" and t.weight_pos == 1
                and prm["batch_group_count"] == 1 and all(v == 1 for v in (prm["lhs_dilation"] or ()))
                and a.shape[prm["dimension_numbers"].lhs_spec[0]] == 1)

    def _conv_squares(self, t, a, d, wp_shape, groups=None):
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
        sq = self._group_sum(jnp.swapaxes(grads * grads, 0, 1), groups).reshape((self.bp, out_ch, in_g, *ks))
        inv = [int(i) for i in np.argsort(dn.rhs_spec)]
        return jnp.transpose(sq, (0,) + tuple(1 + i for i in inv))

    def _chunk(self, ws, others, xl, mask, u, counted=None, step=None):
        per_example = functools.partial(self._per_example, step=step)  # step: :meth:`variant`
        if counted is None:
            outs, z = jax.vmap(per_example, in_axes=(None, None, 0, 0))(ws, others, xl, u)
        else:
            outs, z = jax.vmap(per_example, in_axes=(None, None, 0, 0, 0))(ws, others, xl, u, counted)

        def masked_sum(v):
            return jnp.tensordot(mask, v, axes=1)

        res = []
        for k, w in enumerate(ws):
            t = self.taps.get(k)
            if k in self.tied and step is None:  # in steps, the example's squares are summed already
                res.append(self._pad_groups(self._tied_squares(k, w, *outs[k], mask)))
                continue
            if t is None:
                res.append(self._pad_groups(masked_sum(outs[k])))
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
                # A head's curvature is exact, all of it in the shared group 0: its one sum, kept as an
                # exact layer's only sum (SumState.add_exact), not K' head-sized sums of which K' - 1
                # are zero.
                dwp = jax.vmap(lambda d: vjp_sq(d)[0], in_axes=1)(d2)
            else:
                dwp = masked_sum(outs[k])
            _, vjp_layout = jax.vjp(layout, w)
            dw = jax.vmap(lambda v: vjp_layout(v)[0])(dwp)
            # a head's one sum is complete (its exact group 0); the others' lack the skipped groups
            res.append(dw if k in self.heads else self._pad_groups(dw))
        if self.pool is not None:
            # Only the mean of the groups is wanted (options.pooled): one sum per weight, the groups'
            # sums weighted as the mean weighs them (engine.estimators.mean_weights), as the torch
            # backend pools its signals; the state keeps 1 sum per weight instead of K'.
            res = [native.weighted_sum(r, self.pool)[None] for r in res]
        # Padded rows repeat a real example: they change no logit statistic.
        return res, self.stats(z)

    def _uniforms(self, run: Run, offset: int, start: int, length: int, block: int):
        """The piece's ``(block, options.uniform_columns(T))`` uniforms (rows past ``length`` are padding, zeros)."""
        if not self.draws:
            u = run.extras.get(("u0", block))
            if u is None:
                u = run.extras[("u0", block)] = jnp.zeros((block, 1), self.dtype)
            return u
        # Token logits: D = S draws (+ the signs of per-sequence ggn-topk) per token, token t taking
        # columns t·D .. (t+1)·D - 1 (engine.options.uniform_columns); (n, C) logits: S.
        n_u = self.options.uniform_columns(self.tokens)
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
