"""A model's per-example computation as a flat list of JAX primitives.

The fast GGN path needs, for every weight layer, its input activations and the
signal back-propagated to its output. JAX modules offer no hooks, so the
per-example forward pass is traced once with :func:`jax.make_jaxpr`, nested
``jit``/call primitives are inlined into one flat program, and the program is
analysed: a weight whose only use is one ``dot_general`` or
``conv_general_dilated`` (after layout-only operations such as transposes and
casts) with an activation as the other operand is a *tap*; so is a table whose
only use is one row lookup (a ``gather`` or ``dynamic_slice`` taking whole rows of
a 2-D table at integer ids: ``jnp.take``, ``table[ids]``, flax ``Embed``, equinox
``Embedding``; a :class:`Lookup`); and so is a table *added* to the activations
(a learned position table, method §6.1 "Position tables") whose only use is one
``add`` reached through layout ops, static slices and broadcasts
(:attr:`Tap.added`). A table used by row lookups *and* by ``dot_general`` products
with the activations (a language model's head tied to its token embedding: flax
``Embed.attend``, ``x @ table.T``) and nothing else has one tap per use
(:attr:`Tap.tied`): its per-example gradient is the sum of the uses' gradients,
formed from the signals at each use's output, before the square (method §6.1
"Tied weights"). Re-evaluating the program with a zero perturbation added to
each tap's output (for an added table, to the table's operand of the ``add``)
then yields both the tap inputs (for a lookup, its ids) and, by a VJP with
respect to the perturbations, the signals. Weights used in any other way are
handled by the generic path (per-example VJPs), so the analysis can only choose a
faster path, never a wrong one; :attr:`Program.reasons` says why a weight has no
tap.

A dense tap whose output *is* the program's output, up to a bias added and
layout-only operations, is also marked as a *head* (:attr:`Tap.head`): for it
the sum over signals of squared per-example gradients depends on the signals
only through their squares at the logits, so ``ggn-topk`` gives it the exact
diagonal from one signal per sample (method §6.2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
from normflat.backends.jax.compat import Literal, bind_params, eqn_context
import jax.numpy as jnp
import numpy as np

__all__ = ["Program", "Tap", "trace_program"]

# Primitives whose sub-jaxpr is inlined (parameter holding it, whether it is closed).
_CALLS = {
    "jit": ("jaxpr", True),
    "pjit": ("jaxpr", True),
    "closed_call": ("call_jaxpr", True),
    "core_call": ("call_jaxpr", False),
    "checkpoint": ("jaxpr", False),
    "remat": ("jaxpr", False),
    # jax.checkpoint's primitive (flax's nn.remat / nnx.remat, equinox's filter_checkpoint): the
    # recomputation it asks of the backward changes no number, and inlined, the block's layers
    # keep their fast rules and the program its model order.
    "remat2": ("jaxpr", False),
}
# Unary operations that only permute, reshape or cast a weight: its Hessian
# diagonal maps back through their (linear, entry-permuting) VJP. ``rev`` reverses axes: the
# kernel flip of lax.conv_transpose(transpose_kernel=True) (Keras' transposed convolutions).
_LAYOUT = {"transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze", "expand_dims", "rev"}
_TAP_PRIMS = {"dot_general", "conv_general_dilated"}
# Row lookups of a table: the per-example gradient is a scatter of the output signals into the rows.
_LOOKUP_PRIMS = {"gather", "dynamic_slice"}
# The uses beside row lookups that a weight used several times (a tied table, a layer called twice)
# may have on its fast rule: products with the activations, whose per-example gradient is the VJP
# of the signal at their output (the signal times the activation, or its input patches).
_TIED_USES = {"dot_general", "conv_general_dilated"}
# A table added to the activations (a position table): its per-example gradient is the signal at
# its operand of the addition, pulled back through the ops that bring the table there.
_TABLE_ADD = {"add"}
# Ops that may bring such a table to its addition (operand 0 the table, any other operand a
# constant): each output entry is one entry of the input (a selection), or a broadcast (a sum per
# example in the VJP). Nothing else: the per-example gradient must be exactly that pull-back.
_TABLE_STEPS = _LAYOUT | {"slice", "dynamic_slice", "broadcast_in_dim"}


@dataclass
class _Op:
    prim: Any
    params: dict
    ctx: Any
    ins: list  # ("ref", id) or ("lit", value)
    outs: list  # ref ids


@dataclass(frozen=True)
class Lookup:
    """How a ``gather`` / ``dynamic_slice`` tap takes whole rows of a 2-D table.

    Axes refer to the table as the primitive sees it (after the tap's layout
    chain): every lookup takes a slice of size 1 along ``row_axis`` and the full
    ``feature_axis``; the output holds the features along ``out_feature_axis``
    and one looked-up row at every index of its other axes.
    """

    row_axis: int
    feature_axis: int
    out_feature_axis: int


@dataclass
class Tap:
    """A weight entering the program through one linear primitive.

    Attributes:
        weight: Index of the weight among the program's weight inputs.
        op: Index of the primitive in :attr:`Program.ops`.
        weight_pos: Operand position (0 or 1) of the weight inside that primitive.
        chain: Indices of the layout-only ops from the weight to the operand.
        squares_factor: True when the per-example weight gradient is a single
            outer product (dense layer without extra positions), so that the sum
            of squares over signals is the same primitive applied to squares.
        lookup: For a row lookup of a table (an embedding), how it takes its rows;
            ``None`` for ``dot_general`` / ``conv_general_dilated`` taps.
        head: For a dense layer whose output is the logits (a classification or
            language-model head), the indices of the ops from the tap output to the
            program output (bias additions, casts, transposes; see
            :meth:`Program.head_pullback`); ``None`` for every other tap.
        added: For a table added to the activations (``op`` is the ``add``,
            ``weight_pos`` the table's operand), the ops from the end of ``chain`` to
            that operand whose VJP sums entries of one example (broadcasts, casts) and
            so must come before the squares; ``chain`` is then the leading ops that
            only select or permute entries (static slices, layout ops), whose VJP
            commutes with squaring and is applied to the summed squares. ``None`` for
            every other tap.
        tied: One of several uses of a tied table (method §6.1 "Tied weights"): every tap
            with this :attr:`weight` is one of its uses (a row lookup or a ``dot_general``
            with the activations), and the weight's per-example gradient is the sum of
            theirs, formed before the square. A tied tap is never a :attr:`head` nor
            :attr:`squares_factor`: its squares need each signal's whole gradient.
    """

    weight: int
    op: int
    weight_pos: int
    chain: list[int]
    squares_factor: bool
    lookup: Lookup | None = None
    head: tuple[int, ...] | None = None
    added: tuple[int, ...] | None = None
    tied: bool = False


@dataclass
class Program:
    """A flat per-example program ``(weights, x) -> logits`` and its analysis."""

    ops: list[_Op]
    consts: dict[int, Any]
    weight_refs: list[int]
    other_refs: list[int]
    x_refs: list[int]
    out_refs: list[Any]
    shapes: dict[int, tuple] = field(default_factory=dict)
    dtypes: dict[int, Any] = field(default_factory=dict)
    taps: list[Tap] = field(default_factory=list)
    first_use: list[float] = field(default_factory=list)
    #: Per weight: ``(op, operand position, layout chain)`` of every non-layout use.
    uses: list[list] = field(default_factory=list)
    #: Per weight: why it has no tap (the generic path), ``None`` for a tapped weight.
    reasons: list = field(default_factory=list)
    text: str = ""

    def reorder(self, order: Sequence[int]) -> None:
        """Permute the weight inputs: new weight ``j`` is old weight ``order[j]``."""
        new_index = {old: new for new, old in enumerate(order)}
        self.weight_refs = [self.weight_refs[k] for k in order]
        self.first_use = [self.first_use[k] for k in order]
        self.uses = [self.uses[k] for k in order]
        self.reasons = [self.reasons[k] for k in order]
        for t in self.taps:
            t.weight = new_index[t.weight]

    # ------------------------------------------------------------------ evaluation

    def run(self, weights: Sequence[Any], others: Sequence[Any], x_leaves: Sequence[Any],
            eps: dict[int, Any] | None = None, record: dict[int, Any] | None = None,
            fast_pool: bool = False) -> list[Any]:
        """Evaluate the program; add ``eps[op]`` to tap outputs, store tap activations in ``record``.

        For an added table (:attr:`Tap.added`) ``eps[op]`` is added to the table's operand
        of the ``add`` instead, and nothing is recorded (its squares need only the signal).

        ``fast_pool=True`` evaluates floating-point max-pooling with a reverse-mode-only
        rule (see :func:`_fast_max_pool`); only for callers that never take forward-mode
        derivatives (the GGN's VJPs).
        """
        env: dict[int, Any] = dict(self.consts)
        env.update(zip(self.weight_refs, weights))
        env.update(zip(self.other_refs, others))
        env.update(zip(self.x_refs, x_leaves))
        tap_at = {t.op: t for t in self.taps}

        def read(a):
            return a[1] if a[0] == "lit" else env[a[1]]

        for i, op in enumerate(self.ops):
            args = [read(a) for a in op.ins]
            table = tap_at[i] if i in tap_at and tap_at[i].added is not None else None
            if table is not None and eps is not None and i in eps:
                # the operand, not the sum: an add may broadcast its operands' axes of size 1
                args[table.weight_pos] = args[table.weight_pos] + eps[i]
            with op.ctx:
                if (fast_pool and op.prim.name == "reduce_window_max"
                        and jnp.issubdtype(args[0].dtype, jnp.floating)
                        and all(d == 1 for d in op.params.get("window_dilation") or ())):
                    ans = _fast_max_pool(op.prim, _hashable(op.params))(args[0])
                else:
                    ans = op.prim.bind(*args, **op.params)
            if op.prim.multiple_results:
                env.update(zip(op.outs, ans))
            else:
                if eps is not None and i in eps and table is None:
                    ans = ans + eps[i]
                if record is not None and i in tap_at and table is None:
                    t = tap_at[i]
                    # a lookup's ids are all its other operands (dynamic_slice: one start per axis)
                    record[i] = args[1 - t.weight_pos] if t.lookup is None else args[1:]
                env[op.outs[0]] = ans
        return [read(a) for a in self.out_refs]

    def half_precision_ops(self) -> list[str]:
        """Names of the primitives that compute in float16 / bfloat16."""
        half = {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}
        return sorted({op.prim.name for op in self.ops for r in op.outs if _dtype_in(self.dtypes.get(r), half)})

    def layout_fn(self, tap: Tap) -> Callable[[Any], Any]:
        """The function weight -> the operand the tap primitive sees (for an added table,
        the value its selecting :attr:`Tap.chain` makes of the table)."""
        return self.chain_fn(tap.chain)

    def chain_fn(self, indices: Sequence[int]) -> Callable[[Any], Any]:
        """The function applying the ops ``indices`` in turn, each to the previous result as
        its operand 0 (any other operand of a chain op is a literal or a constant)."""
        chain = [self.ops[i] for i in indices]
        extra = [[a[1] if a[0] == "lit" else self.consts[a[1]] for a in op.ins[1:]] for op in chain]

        def f(w):
            for op, rest in zip(chain, extra):
                with op.ctx:
                    w = op.prim.bind(w, *rest, **op.params)
            return w

        return f

    def table_spread(self, tap: Tap) -> tuple[Callable[[Any], Any], tuple[int, ...], Any]:
        """``(f, shape, dtype)`` of an added table: ``f`` maps the value its :attr:`Tap.chain`
        makes of the table (of ``shape`` and ``dtype``) to its operand of the ``add``
        (:attr:`Tap.added`)."""
        assert tap.added is not None
        ref = self.ops[tap.chain[-1]].outs[0] if tap.chain else self.weight_refs[tap.weight]
        return self.chain_fn(tap.added), tuple(self.shapes[ref]), self.dtypes.get(ref)

    def lookup_rows(self, tap: Tap, index_args: Sequence[Any]) -> Any:
        """The table row that every output slice of a lookup tap reads, ``-1`` where none.

        The tap's own primitive is applied, with the recorded ids, to a table of row
        numbers (the table's shape with a feature axis of size 1), so the rows follow
        exactly the primitive's index semantics: clamped (``CLIP``, ``dynamic_slice``)
        or dropped (``FILL_OR_DROP``; ``PROMISE_IN_BOUNDS`` as its VJP drops them).

        Returns:
            int32 array shaped like the tap output without its feature axis.
        """
        op, lk = self.ops[tap.op], tap.lookup
        shape = list(self.shapes[op.ins[0][1]])
        shape[lk.feature_axis] = 1
        params = dict(op.params)
        sizes = list(params["slice_sizes"])
        sizes[lk.feature_axis] = 1
        params["slice_sizes"] = tuple(sizes)
        if op.prim.name == "gather":
            mode = params["mode"]
            if mode != jax.lax.GatherScatterMode.CLIP:
                params["mode"] = jax.lax.GatherScatterMode.FILL_OR_DROP
            params["fill_value"] = -1
        table = jax.lax.broadcasted_iota(jnp.int32, tuple(shape), lk.row_axis)
        with op.ctx:
            rows = op.prim.bind(table, *index_args, **params)
        return jnp.squeeze(rows, axis=lk.out_feature_axis)

    def head_pullback(self, tap: Tap, cast: bool = True) -> Callable[[Any], Any]:
        """``d -> d'``: signals at the logits ``(cols, *logits)`` to the head tap's output ``(cols, *out)``.

        The ops between a head tap and the output (:attr:`Tap.head`) have a Jacobian
        that only permutes entries (bias additions and casts: the identity), so the
        pull-back is the inverse permutation; computed without the ops' other operands.
        ``cast=False`` keeps ``d``'s dtype (integer labels of the entries: a cast to a
        low-precision head dtype would round them).
        """
        assert tap.head is not None
        steps, ref = [], self.ops[tap.op].outs[0]
        for i in tap.head:  # each op's input on the way is the previous op's output
            op = self.ops[i]
            steps.append((op.prim.name, op.params, self.shapes.get(ref), self.dtypes.get(ref)))
            ref = op.outs[0]
        steps.reverse()

        def pull(d):
            for name, params, shape, dtype in steps:
                if name == "transpose":
                    inv = np.argsort(params["permutation"])
                    d = jnp.transpose(d, (0,) + tuple(1 + int(q) for q in inv))
                elif name in ("reshape", "squeeze", "expand_dims"):
                    d = d.reshape((d.shape[0],) + tuple(shape))
                elif name == "convert_element_type" and dtype is not None and cast:
                    d = d.astype(dtype)
            return d

        return pull

    def tap_fn(self, tap: Tap) -> Callable[[Any, Any], Any]:
        """``(activation, weight operand) -> tap output`` for one tap; for a lookup,
        ``(its recorded index operands, table operand) -> tap output``."""
        op = self.ops[tap.op]

        def f(a, wp):
            if tap.lookup is not None:
                args = [wp, *a]
            else:
                args = [a, wp] if tap.weight_pos == 1 else [wp, a]
            with op.ctx:
                return op.prim.bind(*args, **op.params)

        return f


def _dtype_in(dtype: Any, dtypes: set) -> bool:
    """Whether ``dtype`` is one of ``dtypes`` (extended dtypes such as PRNG keys never are)."""
    if dtype is None:
        return False
    try:
        return jnp.dtype(dtype) in dtypes
    except TypeError:
        return False


def _hashable(params: dict) -> tuple:
    def h(v):
        return tuple(h(e) for e in v) if isinstance(v, (tuple, list)) else v
    return tuple(sorted((k, h(v)) for k, v in params.items()))


@functools.lru_cache(maxsize=64)
def _fast_max_pool(prim, params: tuple) -> Callable[[Any], Any]:
    """Max-pooling whose VJP is a scatter-add at the recorded argmax of each window.

    XLA's own VJP (``select_and_scatter_add``) re-runs the window search for
    every cotangent; the GGN back-propagates C-1 signals per example through the
    same pooling, and on CPU that search dominated the CNN ``ggn`` cost (about 10x
    slower than the scatter in isolation). Here the argmax (first maximum in
    row-major window order, as XLA picks it) is found once in the forward pass.
    """
    kw = dict(params)

    def value(x):
        return prim.bind(x, **kw)

    def argmax(x):
        idx = jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape)

        def red(a, b):
            (av, ai), (bv, bi) = a, b
            take = (bv > av) | ((bv == av) & (bi < ai))
            return jnp.where(take, bv, av), jnp.where(take, bi, ai)

        _, am = jax.lax.reduce_window(
            (x, idx), (jnp.asarray(-jnp.inf, x.dtype), jnp.asarray(-1, jnp.int32)), red,
            kw["window_dimensions"], kw["window_strides"], kw["padding"], kw["base_dilation"],
            kw["window_dilation"])
        # Windows made only of padding (index -1) send their cotangent nowhere.
        return jnp.where(am < 0, x.size, am)

    @jax.custom_vjp
    def pool(x):
        return value(x)

    def fwd(x):
        return value(x), (argmax(x), jnp.zeros_like(x, shape=(0,) + x.shape))

    def bwd(res, dy):
        am, like = res
        shape = like.shape[1:]
        dx = jnp.zeros(math.prod(shape), dy.dtype).at[am.ravel()].add(dy.ravel(), mode="drop")
        return (dx.reshape(shape),)

    pool.defvjp(fwd, bwd)
    return pool


# ---------------------------------------------------------------------- tracing


def trace_program(fn: Callable, weights: Sequence[Any], others: Sequence[Any], x_leaves: Sequence[Any]) -> Program:
    """Trace ``fn(weights, others, x_leaves) -> [logits]`` and return its analysed flat program."""
    closed = jax.make_jaxpr(fn)(list(weights), list(others), list(x_leaves))
    counter = [0]
    ops: list[_Op] = []
    consts: dict[int, Any] = {}
    shapes: dict[int, tuple] = {}
    dtypes: dict[int, Any] = {}

    def fresh() -> int:
        counter[0] += 1
        return counter[0]

    def inline(jaxpr, const_vals, in_atoms):
        env: dict[Any, Any] = {}
        for v, c in zip(jaxpr.constvars, const_vals):
            r = fresh()
            consts[r] = c
            env[v] = ("ref", r)
        for v, a in zip(jaxpr.invars, in_atoms):
            env[v] = a

        def atom(v):
            return ("lit", v.val) if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [atom(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in _CALLS and _CALLS[name][0] in eqn.params:
                sub = eqn.params[_CALLS[name][0]]
                if _CALLS[name][1]:
                    outs = inline(sub.jaxpr, sub.consts, ins)
                else:
                    outs = inline(sub, [], ins)
                for v, a in zip(eqn.outvars, outs):
                    env[v] = a
                continue
            outs = [fresh() for _ in eqn.outvars]
            for v, r in zip(eqn.outvars, outs):
                shapes[r] = tuple(getattr(v.aval, "shape", ()))
                dtypes[r] = getattr(v.aval, "dtype", None)
            ops.append(_Op(eqn.primitive, bind_params(eqn), eqn_context(eqn), ins, outs))
            for v, r in zip(eqn.outvars, outs):
                env[v] = ("ref", r)
        return [atom(v) for v in jaxpr.outvars]

    n_w, n_o = len(weights), len(others)
    in_atoms = [("ref", fresh()) for _ in closed.jaxpr.invars]
    for v, a in zip(closed.jaxpr.invars, in_atoms):
        shapes[a[1]] = tuple(v.aval.shape)
        dtypes[a[1]] = getattr(v.aval, "dtype", None)
    out_atoms = inline(closed.jaxpr, closed.consts, in_atoms)
    refs = [a[1] for a in in_atoms]
    prog = Program(ops, consts, refs[:n_w], refs[n_w:n_w + n_o], refs[n_w + n_o:], out_atoms, shapes)
    prog.dtypes = dtypes
    prog.text = str(closed.jaxpr)
    _analyse(prog, n_w)
    return prog


def _analyse(prog: Program, n_weights: int) -> None:
    """Find taps, the first data-dependent use of every weight (model order) and, for every
    weight without a tap, why (:attr:`Program.reasons`)."""
    derived: dict[int, tuple[int, list[int]]] = {r: (k, []) for k, r in enumerate(prog.weight_refs)}
    # The same, through the wider set of ops that may bring an added table to its addition.
    table: dict[int, tuple[int, list[int]]] = dict(derived)
    # Per weight: every use of it (or of a value of ``table``) by an op outside that set.
    ends: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(n_weights)]
    data_dep: set[int] = set(prog.x_refs)
    uses: dict[int, int] = {}
    for a in prog.out_refs:
        if a[0] == "ref":
            uses[a[1]] = uses.get(a[1], 0) + 1
    consumers: dict[int, int] = {}  # ref -> the (last) op reading it; unique where uses == 1
    for j, op in enumerate(prog.ops):
        for a in op.ins:
            if a[0] == "ref":
                uses[a[1]] = uses.get(a[1], 0) + 1
                consumers[a[1]] = j
    first_use = [np.inf] * n_weights
    weight_uses: list[list] = [[] for _ in range(n_weights)]
    candidates: dict[int, list] = {}
    constant_uses: dict[int, list] = {}  # products with values the data does not reach
    blocked: set[int] = set()
    for i, op in enumerate(prog.ops):
        refs = [a[1] for a in op.ins if a[0] == "ref"]
        name = op.prim.name
        w_ins = [(pos, derived[a[1]]) for pos, a in enumerate(op.ins) if a[0] == "ref" and a[1] in derived]
        t_ins = [(pos, table[a[1]]) for pos, a in enumerate(op.ins) if a[0] == "ref" and a[1] in table]
        # A row lookup is a layer whatever its ids (data or constants, e.g. positions arange(T)).
        lookup = _lookup_spec(prog, op) if name in _LOOKUP_PRIMS and w_ins else None
        is_data = any(r in data_dep for r in refs)
        if is_data:
            data_dep.update(op.outs)
        if len(t_ins) == 1 and _table_step(prog, op, t_ins[0][0]):
            k, chain = t_ins[0][1]
            table[op.outs[0]] = (k, chain + [i])
        else:
            for pos, (k, chain) in t_ins:
                ends[k].append((i, pos, chain))
                if is_data and name in _TABLE_ADD and op.ins[pos][1] not in derived:
                    # a table sliced or broadcast first meets the data here (a layout-only chain: below)
                    first_use[k] = min(first_use[k], i)
                    weight_uses[k].append((op, pos, chain))
        if name in _LAYOUT and len(op.ins) == 1 and len(w_ins) == 1 and len(op.outs) == 1:
            k, chain = w_ins[0][1]
            derived[op.outs[0]] = (k, chain + [i])
            continue
        for pos, (k, chain) in w_ins:
            weight_uses[k].append((op, pos, chain))
            if is_data:
                first_use[k] = min(first_use[k], i)
            if (name in _TAP_PRIMS and len(w_ins) == 1 and is_data and len(op.ins) == 2
                    and op.ins[1 - pos][1] not in derived):
                candidates.setdefault(k, []).append((i, pos, chain, None))
            elif (name == "dot_general" and len(w_ins) == 1 and not is_data and len(op.ins) == 2
                  and op.ins[1 - pos][0] == "ref" and op.ins[1 - pos][1] not in derived):
                # A product with a value the data does not reach (DeBERTa's query and key projections
                # applied to its relative-position table as well as to the activations): one more
                # use, kept only if the weight is also used on the activations (a tied weight).
                constant_uses.setdefault(k, []).append((i, pos, chain, None))
            elif lookup is not None and len(w_ins) == 1 and pos == 0:
                candidates.setdefault(k, []).append((i, pos, chain, lookup))
            else:
                blocked.add(k)
        if not is_data and w_ins and lookup is None and not (name == "dot_general" and len(w_ins) == 1):
            # A weight combined with constants only, e.g. a regularizer: not a plain layer.
            for _, (k, _) in w_ins:
                blocked.add(k)
    # A weight the program returns, itself or through slices and layout ops (known only now that
    # every op is seen): the output is one of its uses.
    for a in prog.out_refs:
        reached = table.get(a[1], derived.get(a[1])) if a[0] == "ref" else None
        if reached is not None:
            ends[reached[0]].append((-1, 0, reached[1]))
    for k, extra in constant_uses.items():
        if k in candidates:
            candidates[k] = sorted(candidates[k] + extra, key=lambda c: c[0])
        else:  # a weight applied to constants only (a regularizer): not a layer
            blocked.add(k)
    for k, cands in candidates.items():
        if k in blocked:
            continue
        if len(cands) > 1:
            prog.taps.extend(_tied_taps(prog, k, cands, derived, uses))
            continue
        i, pos, chain, lookup = cands[0]
        # Every ref on the chain (the weight and each layout result) must be used once.
        chain_refs = [prog.weight_refs[k]] + [prog.ops[j].outs[0] for j in chain]
        if any(uses.get(r, 0) != 1 for r in chain_refs):
            continue
        head = _dense_head(prog, i, pos, uses, consumers, data_dep) if lookup is None else None
        prog.taps.append(Tap(k, i, pos, chain, lookup is None and _squares_factor(prog, prog.ops[i], pos), lookup,
                             head))
    tapped = {t.weight for t in prog.taps}
    for k in range(n_weights):
        tap = None if k in tapped else _added_table(prog, k, ends[k], uses)
        if tap is not None:
            prog.taps.append(tap)
    prog.taps.sort(key=lambda t: t.op)
    prog.first_use = first_use
    prog.uses = weight_uses
    tapped = {t.weight for t in prog.taps}
    prog.reasons = [None if k in tapped else _generic_reason(prog, ends[k]) for k in range(n_weights)]


def _tied_taps(prog: Program, k: int, cands: list, derived: dict, uses: dict) -> list[Tap]:
    """One :attr:`Tap.tied` tap per use of weight ``k`` if it is a tied weight, else none.

    A tied weight: every use is a whole-row lookup or a :data:`_TIED_USES` product with the
    activations (``cands``, all reached through layout ops only): a language model's table
    and its tied head, or a layer called several times (a module shared by two branches or
    applied in a loop written out); and the weight and its layout results are used by nothing
    else (the program's output included). Its per-example gradient is then exactly the sum of
    each use's gradient from the signal at that use's output.
    """
    if any(lookup is None and prog.ops[i].prim.name not in _TIED_USES for i, _, _, lookup in cands):
        return []
    refs = [r for r, (owner, _) in derived.items() if owner == k]
    # Every value derived from the table is read by one layout op (making the next) or one use.
    if sum(uses.get(r, 0) for r in refs) != len(refs) - 1 + len(cands):
        return []
    return [Tap(k, i, pos, chain, False, lookup, None, tied=True) for i, pos, chain, lookup in cands]


def _table_step(prog: Program, op: _Op, pos: int) -> bool:
    """Whether ``op`` may bring a table (its operand ``pos``) to its addition (:data:`_TABLE_STEPS`)."""
    if op.prim.multiple_results or len(op.outs) != 1 or pos != 0 or op.prim.name not in _TABLE_STEPS:
        return False
    if op.prim.name in _LAYOUT or op.prim.name in ("slice", "broadcast_in_dim"):
        return len(op.ins) == 1
    # dynamic_slice: start indices fixed in the program (a slice at data-dependent starts is not)
    return all(a[0] == "lit" or a[1] in prog.consts for a in op.ins[1:])


def _spreads(prog: Program, op: _Op) -> bool:
    """Whether a table step's VJP sums entries (a broadcast that repeats them) or rounds them (a
    cast to another dtype), so that it must come before the squares; the others only select or
    permute entries, and their VJP (zeros elsewhere, the inverse permutation) commutes with squaring."""
    src = prog.shapes.get(op.ins[0][1]) if op.ins[0][0] == "ref" else None
    dst = prog.shapes.get(op.outs[0])
    if op.prim.name == "broadcast_in_dim":
        return src is None or dst is None or math.prod(src) != math.prod(dst)
    if op.prim.name == "convert_element_type":
        src_dtype = prog.dtypes.get(op.ins[0][1]) if op.ins[0][0] == "ref" else None
        return src_dtype is None or jnp.dtype(src_dtype) != jnp.dtype(op.params["new_dtype"])
    return False


def _added_table(prog: Program, k: int, ends: list, uses: dict) -> Tap | None:
    """The tap of weight ``k`` if its only use is one ``add`` (:data:`_TABLE_ADD`) reached through
    :data:`_TABLE_STEPS` ops, each value on the way used once; else None.

    Its per-example gradient is then exactly the pull-back of the signal at its operand of the
    ``add`` through those (linear) ops: the program is per example, so the signal there is this
    example's alone (method §6.1 "Position tables").
    """
    if len(ends) != 1:
        return None
    i, pos, chain = ends[0]
    if i < 0 or prog.ops[i].prim.name not in _TABLE_ADD or len(prog.ops[i].ins) != 2:
        return None
    if not jnp.issubdtype(jnp.dtype(prog.dtypes.get(prog.ops[i].outs[0]) or jnp.int32), jnp.inexact):
        return None
    chain_refs = [prog.weight_refs[k]] + [prog.ops[j].outs[0] for j in chain]
    if any(uses.get(r, 0) != 1 for r in chain_refs):
        return None
    first = next((m for m, j in enumerate(chain) if _spreads(prog, prog.ops[j])), len(chain))
    return Tap(k, i, pos, list(chain[:first]), False, added=tuple(chain[first:]))


#: :attr:`Program.reasons` of a weight no operation of the forward uses: its curvature is zero, and
#: its per-example gradients are symbolic zeros (the session reports it unused, no path).
UNUSED_REASON = "not used by the forward pass"


def _generic_reason(prog: Program, ends: list) -> str:
    """Why a weight without a tap takes the generic path, from its uses (``ends``: the ops that
    use it beyond the layout ops, slices and broadcasts that may bring a table to an addition)."""
    names = ["the output" if i < 0 else prog.ops[i].prim.name for i, _, _ in ends]
    if not names:
        return UNUSED_REASON
    if len(names) > 1:
        counts = {n: names.count(n) for n in names}  # a layer called in a loop: one use per call
        listed = ", ".join(n if c == 1 else f"{n} ×{c}" for n, c in counts.items())
        # A table that is looked up is a tied table gone wrong (also a fixed row of it added), not a
        # position table read twice: say what a tied table may do.
        if any(n in _LOOKUP_PRIMS for n in names):
            return (f"used {len(names)} times in the forward pass ({listed}): a tied table is fast only when "
                    "every use is a row lookup or a product with the activations (dot_general)")
        if any(n in _TABLE_ADD for n in names):
            return f"also used outside its addition to the activations ({len(names)} uses: {listed})"
        return (f"used {len(names)} times in the forward pass ({listed}): a weight used several times is fast "
                "only when every use is a product with the activations (dot_general, conv_general_dilated) or a "
                "row lookup")
    return f"its use in the forward pass ({names[0]}) has no fast rule"


def _squares_factor(prog: Program, op: _Op, weight_pos: int) -> bool:
    """True if the activation has no positions besides the contracted features."""
    if op.prim.name != "dot_general":
        return False
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    act_pos = 1 - weight_pos
    contract, batch = (lc, lb) if act_pos == 0 else (rc, rb)
    if len(batch):
        return False
    shape = prog.shapes.get(op.ins[act_pos][1])
    if shape is None:
        return False
    free = [d for j, d in enumerate(shape) if j not in tuple(contract)]
    return int(np.prod(free, dtype=np.int64)) == 1


#: Ops between a head's ``dot_general`` and the logits whose Jacobian is the identity
#: (a bias or another term independent of the data added, a cast) or a permutation.
_HEAD_IDENTITY = {"add", "sub", "convert_element_type", "copy", "copy_p"}
_HEAD_RESHAPE = {"reshape", "squeeze", "expand_dims"}


def _dense_head(prog: Program, index: int, weight_pos: int, uses: dict, consumers: dict,
                data_dep: set) -> tuple[int, ...] | None:
    """The ops from a dense tap to the program output if the tap is a head, else None.

    A head's output reaches the logits through bias additions, casts and layout
    ops only, so the signals at its output are the logits' signals, permuted. Its
    per-example squared gradients summed over signals then need only the squared
    signals, i.e. the logit-Hessian diagonal, when the outputs that share a weight
    entry have no curvature between them: for ``(C,)`` logits every weight entry
    must reach one output (no positions besides the contracted features), for
    ``(T, C)`` token logits the positions must be the tokens and the weight's
    output axis the classes (the loss Hessian is block-diagonal over tokens,
    method §6.3). As in the other backends, only a layer whose output is the model
    output counts: a sum with another data-dependent term does not.
    """
    op = prog.ops[index]
    if op.prim.name != "dot_general" or len(prog.out_refs) != 1 or prog.out_refs[0][0] != "ref":
        return None
    out_ref = prog.out_refs[0][1]
    out_shape = prog.shapes.get(out_ref)
    if out_shape is None or len(out_shape) not in (1, 2):
        return None
    tokens = len(out_shape) == 2
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    act_pos = 1 - weight_pos
    a_shape = prog.shapes.get(op.ins[act_pos][1])
    lhs_shape = prog.shapes.get(op.ins[0][1]) if op.ins[0][0] == "ref" else None
    if a_shape is None or lhs_shape is None:
        return None
    contract, batch = (lc, lb) if act_pos == 0 else (rc, rb)
    a_free = [j for j in range(len(a_shape)) if j not in tuple(contract) and j not in tuple(batch)]
    # dot_general's output axes: batch, then the lhs free axes, then the rhs free axes.
    start = len(lb) + (0 if act_pos == 0 else len(lhs_shape) - len(lc) - len(lb))
    r = op.outs[0]
    # What each axis of the value on the way holds: "a" activation positions, "w" the weight's
    # output (or batch) axes, "1" an axis of size 1 (the per-example program's own batch of one).
    kinds: list[str] | None = ["a" if start <= j < start + len(a_free) else "w"
                               for j in range(len(prog.shapes.get(r, ())))]
    kinds = [k if d != 1 else "1" for k, d in zip(kinds, prog.shapes.get(r, ()))]
    if not tokens and math.prod(a_shape[j] for j in a_free) != 1:
        return None
    chain: list[int] = []
    while True:
        if uses.get(r, 0) != 1:
            return None  # another use: the signal at the tap output is not the logits' alone
        if r == out_ref:
            break
        j = consumers.get(r)
        if j is None:
            return None
        nxt = prog.ops[j]
        name = nxt.prim.name
        if nxt.prim.multiple_results or len(nxt.outs) != 1:
            return None
        if name in ("add", "sub"):
            at = [p for p, a in enumerate(nxt.ins) if a == ("ref", r)]
            if len(nxt.ins) != 2 or len(at) != 1 or (name == "sub" and at[0] != 0):
                return None
            other = nxt.ins[1 - at[0]]
            if (other[0] == "ref" and other[1] in data_dep) or prog.shapes.get(nxt.outs[0]) != prog.shapes.get(r):
                return None
        elif name == "transpose":
            if kinds is not None:
                kinds = [kinds[p] for p in nxt.params["permutation"]]
        elif name in _HEAD_RESHAPE:
            if tokens:
                # Only axes of size 1 may come or go: the positions must stay the tokens.
                old, new = prog.shapes.get(r, ()), prog.shapes.get(nxt.outs[0], ())
                if kinds is None or [d for d in old if d != 1] != [d for d in new if d != 1]:
                    return None
                it = iter(k for k in kinds if k != "1")
                kinds = ["1" if d == 1 else next(it) for d in new]
            else:
                kinds = None  # any entry permutation keeps one output per weight entry
        elif name not in _HEAD_IDENTITY:
            return None
        chain.append(j)
        r = nxt.outs[0]
    if tokens and (kinds is None or kinds[0] not in ("a", "1") or kinds[1] != "w"):
        return None
    return tuple(chain)


def _lookup_spec(prog: Program, op: _Op) -> Lookup | None:
    """How ``op`` (a ``gather`` / ``dynamic_slice``) takes whole rows of a 2-D table, or None.

    Only slices of one row and every feature qualify: then each output slice is one
    table row in order, and the per-example gradient of the table is the sum of the
    output signals of the slices reading each row. Anything else (element gathers,
    partial rows, batching dimensions, the ``ONE_HOT`` mode) stays generic.
    """
    if not op.ins or op.ins[0][0] != "ref" or any(a[0] == "ref" and a[1] == op.ins[0][1] for a in op.ins[1:]):
        return None
    shape = prog.shapes.get(op.ins[0][1])
    sizes = tuple(op.params.get("slice_sizes") or ())
    if shape is None or len(shape) != 2 or len(sizes) != 2:
        return None
    rows = [r for r in (0, 1) if sizes[r] == 1 and sizes[1 - r] == shape[1 - r]]
    if not rows:
        return None
    row, feat = rows[0], 1 - rows[0]
    if op.prim.name == "dynamic_slice":
        return Lookup(row, feat, feat)  # the output is the (1, d) or (d, 1) slice itself
    dn = op.params["dimension_numbers"]
    if (tuple(dn.operand_batching_dims) or tuple(dn.start_indices_batching_dims) or feat in dn.collapsed_slice_dims
            or op.params["mode"] not in (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.FILL_OR_DROP,
                                         jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)):
        return None
    kept = [a for a in (0, 1) if a not in dn.collapsed_slice_dims]  # operand axes behind offset_dims, in order
    return Lookup(row, feat, int(dn.offset_dims[kept.index(feat)]))
