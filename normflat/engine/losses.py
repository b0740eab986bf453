"""The losses and their curvature factors, written once against an array namespace.

Every function takes the array namespace ``xp`` first: ``array_api_compat``'s
namespace of torch arrays, ``jax.numpy``, numpy, or :data:`keras.ops` (the Keras
backend passes a tiny adapter); the functions use only ``mean``, ``sum``,
``max``, ``abs``, ``sqrt``, ``exp``, ``log``, ``where``, ``arange``, ``astype``,
``stack``, ``concat`` and ``reshape`` (see :func:`namespace_check`), and work under ``jit``/``vmap``/
``tf.function``. The mathematics is method §6–§7:

* normalized logits ``u = τ ẑ``, ``ẑ = (z − z̄) / √(mean((z − z̄)²) + ε)``,
  computed after dividing by the largest centred logit, so that logits near the
  float32 range (1e20 and beyond) neither overflow nor lose the value;
* the softmax cross-entropy Hessian in ``u`` is ``H = diag(p) − p pᵀ = S Sᵀ``
  with columns ``s_c = √p_c (e_c − p)``; a Householder reflection removes the
  column along the null vector ``√p`` (:func:`ggn_factor`: ``C − 1`` signals);
* ``ggn-mc`` replaces ``S`` by ``e_ỹ − p`` with ``ỹ ~ p`` drawn from the
  framework-free uniforms of :mod:`normflat.engine.random`;
* ``ggn-topk`` splits ``H = Σ_c p_c (e_c − p)(e_c − p)ᵀ`` into the ``k`` most
  probable classes, taken exactly, and the rest, sampled (:func:`topk_signals`);
* for ``nsce`` the signals are pulled back through the normalization, whose
  Jacobian ``(τ/σ)(P − ẑ ẑᵀ / C)`` is symmetric (:func:`pull_back`);
* token logits ``(n, T, C)`` (method §6.3): every counted token is one term of
  the mean loss; labels equal to ``ignore_index`` are masked out. The exact ``ggn``
  places the signals of token ``t`` at token ``t`` only, so that every (token,
  signal) pair is its own squared per-sample gradient; the stochastic estimators sum
  each signal over the sequence's tokens with independent random signs (one
  back-propagation per signal and sequence, :func:`token_signals`).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from normflat.engine import native
from normflat.engine.options import NSCE_EPS, AnalysisOptions

__all__ = [
    "normalize_logits",
    "log_softmax",
    "loss_sum",
    "one_hot",
    "ggn_factor",
    "mc_signals",
    "topk_signals",
    "signal_slots",
    "pull_back",
    "output_signals",
    "Factor",
    "output_factor",
    "logit_hessian_diagonal",
    "diagonal_signals",
    "token_signals",
    "SequenceClasses",
    "sequence_classes",
    "sequence_dense",
    "sequence_factor",
    "classes_factor",
    "sequence_members",
    "pool_signals",
    "padding_signals",
    "real_signals",
    "zero_signals",
    "logit_stats",
    "combined_logit_stats",
    "check_logit_stats",
    "softmax_saturation",
    "saturation_warning",
    "LOGIT_STATS",
    "CONSTANT_LOGITS_RMS",
    "check_output_shape",
    "check_same_classes",
    "check_samples_apart",
    "one_sample_error",
    "quoted_error",
    "SAMPLES_APART_ROWS",
    "classes_first",
    "check_loss_value",
    "namespace_check",
    "LOGIT_BLOCK_ENTRIES",
]

#: ``nsce`` refuses rows whose centred logits have an RMS below this: there the ε of
#: the normalization changes the normalized logits by more than 5e-5 relatively and the
#: curvature is of order 1/ε (a zero-initialized head gives a Hessian trace of ~1e13).
CONSTANT_LOGITS_RMS = math.sqrt(1e4 * NSCE_EPS)


#: Entries of ``(rows, C)`` logits that the probabilities, the class selection, the
#: logit-Hessian diagonal and the logit checks take at once where arrays are mutable
#: (numpy, torch): each of these holds up to about ten temporaries of its input's size, so
#: the ``n·T`` token rows of a large vocabulary are taken a block of rows at a time and the
#: temporaries are those of one block (4 MiB each in float32), not of all the rows (method
#: §9). Inside compiled code the rows are taken whole (JAX: XLA fuses the temporaries); the
#: Keras step blocks token logits by tokens itself (``backends.keras.ggn.token_blocks``).
LOGIT_BLOCK_ENTRIES = 1 << 20


def _row_blocks(rows: Any) -> list[tuple[int, int]] | None:
    """Row ranges ``[lo, hi)`` of ``(n, C)`` ``rows`` of at most :data:`LOGIT_BLOCK_ENTRIES`
    entries (at least one row each); ``None`` where the rows are taken whole: one block is
    enough, the arrays are immutable, or the number of rows is not static (tracing)."""
    if len(rows.shape) != 2 or not native.mutable(rows):
        return None
    n, c = rows.shape
    if n is None or int(n) * int(c) <= LOGIT_BLOCK_ENTRIES:
        return None
    step = max(1, LOGIT_BLOCK_ENTRIES // int(c))
    return [(lo, min(int(n), lo + step)) for lo in range(0, int(n), step)]


def _filled(xp: Any, rows: Any, blocks: list[tuple[int, int]], fn: Any) -> tuple:
    """The arrays of ``fn(rows[lo:hi])`` (a tuple) computed a block of rows at a time and written into
    arrays of the rows' leading size (each output of ``fn`` is ``(hi − lo, ·)``)."""
    outs: list[Any] = []
    for lo, hi in blocks:
        parts = fn(rows[lo:hi])
        if not outs:
            n = int(rows.shape[0])
            outs = [xp.empty((n, *part.shape[1:]), dtype=part.dtype, device=part.device) for part in parts]
        for out, part in zip(outs, parts):
            out[lo:hi] = part
        del parts
    return tuple(outs)


def _row_dots(xp: Any, a: Any, b: Any) -> Any:
    """``(n,)`` dot products of the rows of two ``(n, C)`` arrays (a block of rows at a time)."""
    blocks = _row_blocks(b)
    if blocks is None:
        return xp.sum(a * b, axis=-1)
    return xp.concat([xp.sum(a[lo:hi] * b[lo:hi], axis=-1) for lo, hi in blocks], axis=0)


def _permute(xp: Any, x: Any, axes: tuple[int, ...]) -> Any:
    fn = getattr(xp, "permute_dims", None) or xp.transpose
    return fn(x, axes)


def _arange_like(xp: Any, n: int, like: Any) -> Any:
    try:
        return xp.arange(n, device=getattr(like, "device", None))
    except TypeError:  # namespaces without a device argument (keras.ops, numpy < 2)
        return xp.arange(n)


def normalize_logits(xp: Any, z: Any, temperature: float = 1.0) -> tuple[Any, Any, Any]:
    """Normalized logits ``u = τ ẑ`` of ``(..., C)`` logits, stable at any magnitude.

    Returns:
        ``(u, zhat, sigma)``: ``u = τ ẑ``, ``ẑ`` and ``σ = √(mean((z − z̄)²) + ε)``
        with a trailing axis of size 1; ``σ`` is computed as ``t · √(mean((zc/t)²) +
        ε/t²)`` with ``t = max(max|zc|, √ε)``, which neither overflows nor underflows.
    """
    zc = z - xp.mean(z, axis=-1, keepdims=True)
    m = xp.max(xp.abs(zc), axis=-1, keepdims=True)
    # Divide by t = max(m, √ε) rather than m: (ε/m²) would overflow for m ~ 1e20 and lose
    # precision (subnormal m²) for m ~ 1e-20 in float32; with t >= √ε the added term
    # q² = ε/t² lies in [0, 1].
    root_eps = math.sqrt(NSCE_EPS)
    t = xp.where(m > root_eps, m, xp.ones_like(m) * root_eps)
    zs = zc / t
    q = root_eps / t
    s = xp.sqrt(xp.mean(zs * zs, axis=-1, keepdims=True) + q * q)
    zhat = zs / s
    return temperature * zhat, zhat, t * s


def log_softmax(xp: Any, u: Any) -> Any:
    """``log softmax(u)`` over the last axis, stable for large logits."""
    shifted = u - xp.max(u, axis=-1, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))


def one_hot(xp: Any, labels: Any, num_classes: int, dtype: Any) -> Any:
    """``(n, C)`` one-hot rows of integer ``labels``."""
    classes = _arange_like(xp, num_classes, labels)
    return xp.astype(labels[..., None] == classes, dtype)


def loss_sum(xp: Any, logits: Any, labels: Any, options: AnalysisOptions) -> Any:
    """Sum over samples (or counted tokens) of the built-in loss (``"ce"`` or ``"nsce"``).

    Args:
        xp: Array namespace of ``logits``.
        logits: ``(n, C)`` logits, or ``(n, T, C)`` token logits.
        labels: ``(n,)`` (or ``(n, T)``) integer class indices in the same namespace;
            negative entries (``ignore_index``) are not counted.
        options: The analysis options (loss name and temperature).
    """
    u = normalize_logits(xp, logits, options.temperature)[0] if options.loss == "nsce" else logits
    counted = labels >= 0
    safe = xp.where(counted, labels, xp.zeros_like(labels))
    target = one_hot(xp, safe, int(logits.shape[-1]), logits.dtype) * xp.astype(counted, logits.dtype)[..., None]
    return -xp.sum(target * log_softmax(xp, u))


def _softmax(xp: Any, u: Any) -> Any:
    e = xp.exp(u - xp.max(u, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def _probabilities(xp: Any, logits: Any, options: AnalysisOptions) -> tuple[Any, Any, Any]:
    """``(p, ẑ, σ)``: the softmax of the (normalized, for ``nsce``) logits; ``ẑ``, ``σ`` of
    :func:`normalize_logits` for ``nsce``, ``None`` for ``ce`` (a block of rows at a time,
    :data:`LOGIT_BLOCK_ENTRIES`)."""
    blocks = _row_blocks(logits)
    if blocks is not None:
        if options.loss == "nsce":
            return _filled(xp, logits, blocks, lambda rows: _probabilities(xp, rows, options))
        return _filled(xp, logits, blocks, lambda rows: _probabilities(xp, rows, options)[:1]) + (None, None)
    if options.loss == "nsce":
        u, zhat, sigma = normalize_logits(xp, logits, options.temperature)
        return _softmax(xp, u), zhat, sigma
    return _softmax(xp, logits), None, None


def ggn_factor(xp: Any, p: Any) -> Any:
    """``C − 1`` signals ``(C−1, n, C)`` whose outer products sum to ``diag(p) − p pᵀ``.

    ``S = diag(√p) − p √pᵀ`` has ``S Sᵀ = diag(p) − p pᵀ`` and ``S √p = 0``. With the
    Householder reflection ``R`` mapping ``e_C`` to ``−√p`` (``v = √p + e_C``,
    ``|v|² = 2(1 + √p_C) >= 2``: no cancellation), ``(S R)(S R)ᵀ = S Sᵀ`` and the
    last column of ``S R`` vanishes. ``S R = S − (2/|v|²)(S v) vᵀ`` with
    ``S v = √p ⊙ v − p (√pᵀ v)``.
    """
    c = int(p.shape[-1])
    u = xp.sqrt(p)
    eye = xp.astype(_arange_like(xp, c, p)[:, None] == _arange_like(xp, c, p)[None, :], p.dtype)
    S = eye[None] * u[:, None, :] - p[:, :, None] * u[:, None, :]  # (n, C, C)
    if c == 1:
        return _permute(xp, S, (2, 0, 1))
    _, v, sv, scale = _householder(xp, p)
    SR = S - scale[:, None, None] * sv[:, :, None] * v[:, None, :]
    return _permute(xp, SR[:, :, : c - 1], (2, 0, 1))


def _householder(xp: Any, p: Any) -> tuple[Any, Any, Any, Any]:
    """``(√p, v, S v, 2/|v|²)`` of :func:`ggn_factor`'s reflection, ``v = √p + e_C``."""
    c = int(p.shape[-1])
    root = xp.sqrt(p)
    v = root + xp.astype(_arange_like(xp, c, p) == c - 1, p.dtype)[None, :]
    sv = root * v - p * xp.sum(root * v, axis=-1, keepdims=True)
    return root, v, sv, 2 / xp.sum(v * v, axis=-1)


#: Comparisons of one sample's draws with its cumulative class weights formed at once in
#: :func:`_draw`: ``w`` draws against ``C − 1`` weights, ``w·(C − 1)`` at most this (32 KiB per
#: sample in float64), but always at least :data:`MIN_DRAWS_PER_COMPARISON` draws. Two draws at a
#: time at any ``C`` built one comparison per two draws: 750 for 1500 draws, seconds of tracing
#: in a compiled step and as many small operations per batch in eager code, where ten classes
#: need no such bound.
DRAW_COMPARISON_ENTRIES = 4096
#: Fewest draws compared at once, however many the classes (two: the bound before the entries').
MIN_DRAWS_PER_COMPARISON = 2


def _cumsum(xp: Any, x: Any) -> Any:
    fn = getattr(xp, "cumulative_sum", None) or xp.cumsum
    return fn(x, axis=-1)


def draws_per_comparison(classes: int) -> int:
    """Draws compared at once in :func:`_draw` among ``classes`` classes
    (:data:`DRAW_COMPARISON_ENTRIES`, at least :data:`MIN_DRAWS_PER_COMPARISON`)."""
    return max(MIN_DRAWS_PER_COMPARISON, DRAW_COMPARISON_ENTRIES // max(classes - 1, 1))


def _draw(xp: Any, weights: Any, uniforms: Any) -> Any:
    """``(n, S)`` float class indices drawn with probabilities ``weights / Σ weights``.

    Draw ``d`` of a sample is the first class whose cumulative weight exceeds
    ``uniforms[:, d] · Σ weights`` (how many cumulative weights lie at or below it,
    clipped to ``C − 1``: rounding can leave the last sum just below the target).
    Classes of weight 0 are never drawn.
    """
    c = int(weights.shape[1])  # the sample axis may be unknown while tracing (tf.function, relaxed shapes)
    draws = int(uniforms.shape[1])
    cum = _cumsum(xp, weights)  # (n, C)
    target = uniforms * cum[:, c - 1:]
    counts = []
    # Some draws at a time: the comparisons (n, draws, C − 1) of all draws among many classes
    # would be the largest array of a whole analysis (4 MiB per 10 draws of 64 samples at 1000
    # classes); among few classes, all draws at once.
    step = draws_per_comparison(c)
    for lo in range(0, draws, step):
        hi = min(draws, lo + step)
        below = xp.astype(cum[:, None, : c - 1] <= target[:, lo:hi, None], weights.dtype)  # (n, w, C-1)
        counts.append(xp.sum(below, axis=-1))
    return counts[0] if len(counts) == 1 else xp.concat(counts, axis=1)


def _deal(xp: Any, x: Any, groups: int, members: int, fill: float) -> Any:
    """``(n, S)`` per-draw values dealt round-robin into ``(K, members, n)``, padded with ``fill``.

    Draw ``d = m·K + k`` sits at ``(k, m)``; one reshape does it, vectorized (a loop over
    draws would build thousands of ops in compiled code).
    """
    pad = members * groups - int(x.shape[1])
    if pad > 0:
        x = xp.concat([x] + [xp.ones_like(x[:, :1]) * fill] * pad, axis=1)
    return _permute(xp, xp.reshape(x, (-1, members, groups)), (2, 1, 0))


def _group_weights(xp: Any, counts: list[int], draws: int, like: Any, f: Any) -> Any:
    """``(S,)``: ``1 / f(m_k)`` for each draw ``d``, ``k = d mod K`` (``m_k`` = ``counts[k]``)."""
    group = _arange_like(xp, draws, like) % len(counts)
    return sum((1.0 / f(counts[k])) * xp.astype(group == k, like.dtype) for k in range(len(counts)))


def _class_signals(xp: Any, p: Any, index: Any, scale: Any) -> Any:
    """``scale ⊙ (e_index − p)``: ``(G, M, n, C)`` signals from ``(G, M, n)`` classes and scales.

    One expression over the final layout (no per-group stacking): a class index of
    ``-1`` with scale 0 is a zero (padding) signal.
    """
    c = int(p.shape[1])
    classes = xp.astype(_arange_like(xp, c, p), p.dtype)
    onehot = xp.astype(index[:, :, :, None] == classes, p.dtype)
    return scale[:, :, :, None] * (onehot - p)


def mc_signals(xp: Any, p: Any, uniforms: Any, groups: int) -> Any:
    """Monte-Carlo signals ``(K, M, n, C)``: ``(e_ỹ − p)/√m_k`` with ``ỹ ~ p``.

    Args:
        xp: Array namespace.
        p: ``(n, C)`` softmax probabilities.
        uniforms: ``(n, S)`` uniforms of :func:`normflat.engine.random.sample_uniforms`
            in ``p``'s namespace and dtype; draw ``d`` picks the first class whose
            cumulative probability exceeds it.
        groups: ``K``; draw ``d`` belongs to group ``d mod K``, whose ``m_k`` members
            are scaled by ``1/√m_k`` so that each group's squares average its draws.
    """
    return _class_signals(xp, p, *_mc_classes(xp, p, uniforms, groups))


def _mc_classes(xp: Any, p: Any, uniforms: Any, groups: int) -> tuple[Any, Any]:
    """``ggn-mc``'s ``(K, M, n)`` drawn classes and scales ``1/√m_k`` (:func:`mc_signals`)."""
    draws = int(uniforms.shape[1])
    members = -(-draws // groups)
    counts = [len(range(k, draws, groups)) for k in range(groups)]
    index = _deal(xp, _draw(xp, p, uniforms), groups, members, -1.0)  # (K, M, n)
    scale = _deal(xp, xp.ones_like(uniforms) * _group_weights(xp, counts, draws, p, math.sqrt),
                  groups, members, 0.0)  # (K, M, n)
    return index, scale


def topk_signals(xp: Any, p: Any, uniforms: Any, top: int, groups: int, members: int) -> Any:
    """``ggn-topk`` signals ``(1 + K, M, n, C)``: the top classes exactly, the rest sampled.

    With ``T`` the ``k`` most probable classes of a sample (ties to the lower index) and
    ``r = Σ_{c∉T} p_c``, ``H = diag(p) − p pᵀ = Σ_c p_c (e_c − p)(e_c − p)ᵀ`` is

    * group 0 (shared by every group estimate): ``√p_c (e_c − p)`` for ``c ∈ T``, exact;
    * group ``k >= 1``: its ``m_k`` draws ``c̃ ~ p_c / r`` over ``c ∉ T``, each
      ``√(r / m_k) (e_c̃ − p)``, whose squares have expectation
      ``Σ_{c∉T} p_c (e_c − p)(e_c − p)ᵀ``: unbiased, with variance that vanishes as the
      top classes hold the mass (a confident model) and does not grow with ``C``.

    Args:
        xp: Array namespace.
        p: ``(n, C)`` softmax probabilities.
        uniforms: ``(n, S)`` uniforms of :func:`normflat.engine.random.sample_uniforms`
            in ``p``'s namespace and dtype (draw ``d`` belongs to group ``d mod K``).
        top: ``k`` (clipped to ``C``).
        groups: ``K``.
        members: ``M``: signals per group; shorter groups are zero-padded.
    """
    return _class_signals(xp, p, *_topk_classes(xp, p, uniforms, top, groups, members))


def _topk_classes(xp: Any, p: Any, uniforms: Any, top: int, groups: int, members: int) -> tuple[Any, Any]:
    """``ggn-topk``'s ``(1 + K, M, n)`` classes and scales (:func:`topk_signals`)."""
    c = int(p.shape[1])
    k = min(top, c)
    draws = int(uniforms.shape[1])
    classes = xp.astype(_arange_like(xp, c, p), p.dtype)[None, :]
    remaining = p
    chosen = xp.zeros_like(p)
    top_index, top_scale = [], []
    for _ in range(k):
        # The first most probable class not chosen yet (chosen ones are set to -1 < any p). The
        # fill C − 1 changes nothing where a class equals the maximum; where none does (NaN
        # probabilities of overflowing logits, refused after the loop) it keeps every index in
        # range, so the gathers that follow never fail inside a compiled step or on a device.
        best = xp.max(remaining, axis=-1, keepdims=True)
        index = xp.min(xp.where(remaining == best, classes, xp.ones_like(p) * (c - 1)), axis=-1, keepdims=True)
        e = xp.astype(classes == index, p.dtype)
        top_index.append(index[:, 0])
        top_scale.append(xp.sqrt(xp.sum(p * e, axis=-1)))
        chosen = chosen + e
        remaining = xp.where(e > 0, -xp.ones_like(p), remaining)
    rest = p * (1 - chosen)
    r = xp.sum(rest, axis=-1, keepdims=True)  # (n, 1)
    none = top_index[0] * 0 - 1  # (n,) class -1: a padding slot
    zero = top_scale[0] * 0
    top_index += [none] * (members - k)
    top_scale += [zero] * (members - k)
    counts = [len(range(g, draws, groups)) for g in range(groups)]
    inv = _group_weights(xp, counts, draws, p, lambda m: m)  # (S,): 1/m_k of each draw's group
    index = xp.concat([xp.stack(top_index)[None], _deal(xp, _draw(xp, rest, uniforms), groups, members, -1.0)],
                      axis=0)  # (1 + K, M, n)
    scale = xp.concat([xp.stack(top_scale)[None], _deal(xp, xp.sqrt(r * inv), groups, members, 0.0)], axis=0)
    return index, scale


def signal_slots(options: AnalysisOptions, num_classes: int, sequence: bool = False) -> list[tuple[int, int]]:
    """The ``(group, member)`` slots of the ``(K', M)`` signal layout that hold real signals.

    The others are zero padding; a backend may skip them (each would cost one
    back-propagation and add nothing). ``ggn``: all ``C − 1``; ``ggn-mc``: draw ``d`` is
    member ``d // K`` of group ``d mod K``; ``ggn-topk``: group 0's ``min(k, C)`` exact
    signals, then the draws of groups ``1..K`` as for ``ggn-mc``.

    ``sequence``: the per-sequence signals of token logits (:func:`token_signals` where
    :meth:`~normflat.engine.options.AnalysisOptions.sequence_layout` holds, ``M`` of
    :meth:`~normflat.engine.options.AnalysisOptions.token_signals_per_group`): ``ggn-mc``
    as above; ``ggn-topk``: group 0 is all zeros, and each sampled group holds its
    ``min(k, C)`` signed top-class signals, then its signed draws.
    """
    if sequence and options.estimator == "ggn-topk":
        assert options.samples is not None and options.top_classes is not None
        k, top = options.groups, min(options.top_classes, num_classes)
        return [(g + 1, j) for g in range(k) for j in range(top)
                ] + [(g + 1, top + j) for g in range(k) for j in range(-(-options.samples // k))
                     if g + j * k < options.samples]
    m = options.signals_per_group(num_classes)
    if options.estimator == "ggn":
        return [(0, j) for j in range(m)]
    assert options.samples is not None
    k, samples = options.groups, options.samples
    slots = []
    if options.estimator == "ggn-topk":
        assert options.top_classes is not None
        slots = [(0, j) for j in range(min(options.top_classes, num_classes))]
    offset = 1 if options.shared_group else 0
    for g in range(k):
        for j in range(m):
            if g + j * k < samples:
                slots.append((g + offset, j))
    return slots


def pull_back(xp: Any, signals: Any, zhat: Any, sigma: Any, temperature: float) -> Any:
    """Signals in the normalized logits pulled back to the raw logits (``nsce``).

    The normalization's Jacobian ``(τ/σ)(P − ẑ ẑᵀ/C)`` (``P`` the centring
    projection) is symmetric, so ``Jᵀ s = (τ/σ)(s − s̄ − ẑ (ẑ·s)/C)``.
    """
    c = int(signals.shape[-1])
    centred = signals - xp.mean(signals, axis=-1, keepdims=True)
    proj = xp.sum(signals * zhat, axis=-1, keepdims=True) / c
    return (temperature / sigma) * (centred - zhat * proj)


def logit_hessian_diagonal(xp: Any, logits: Any, options: AnalysisOptions) -> Any:
    """``(n, C)`` diagonal of the loss Hessian in the raw logits, in ``O(C)`` per sample.

    ``ce``: ``p − p²``. ``nsce``: the diagonal of ``J H J`` with ``H = diag(p) − p pᵀ``
    at the normalized logits and the symmetric normalization Jacobian
    ``J = a (I − (1 + ẑ ẑᵀ)/C)``, ``a = τ/σ`` (:func:`pull_back`):
    ``(JHJ)_ii = Σ_c J_ic² p_c − (Σ_c J_ic p_c)²`` with
    ``Σ_c J_ic² p_c = a² [p_i − 2 p_i (1 + ẑ_i²)/C + (1 + 2 ẑ_i μ₁ + ẑ_i² μ₂)/C²]``,
    ``Σ_c J_ic p_c = a [p_i − (1 + ẑ_i μ₁)/C]``, ``μ_r = Σ_c p_c ẑ_c^r``.
    """
    blocks = _row_blocks(logits)
    if blocks is not None:
        return _filled(xp, logits, blocks, lambda rows: (logit_hessian_diagonal(xp, rows, options),))[0]
    p, zhat, sigma = _probabilities(xp, logits, options)
    if options.loss != "nsce":
        return p - p * p
    c = float(logits.shape[-1])
    a = options.temperature / sigma
    mu1 = xp.sum(p * zhat, axis=-1, keepdims=True)
    mu2 = xp.sum(p * zhat * zhat, axis=-1, keepdims=True)
    second = p - 2 * p * (1 + zhat * zhat) / c + (1 + 2 * zhat * mu1 + zhat * zhat * mu2) / (c * c)
    first = p - (1 + zhat * mu1) / c
    d = a * a * (second - first * first)
    return xp.where(d > 0, d, xp.zeros_like(d))  # rounding; the exact value is >= 0 (H is PSD)


def diagonal_signals(xp: Any, logits: Any, options: AnalysisOptions) -> Any:
    """``(K', 1, n, C)``: one signal per sample whose square is the logit-Hessian diagonal.

    For a layer whose output *is* the logits (a dense classification head), the sums
    of squared per-sample gradients depend on the signals only through
    ``Σ_m s_m ⊙ s_m`` per output unit, which is the diagonal of the loss Hessian in
    the logits for the exact factor; ``√diag`` in the shared group 0 (zeros in the
    sampled groups) therefore gives that layer its exact GGN diagonal at the cost of
    one signal, whatever the estimator's draws (``ggn-topk``, method §6.2).
    """
    root = xp.sqrt(logit_hessian_diagonal(xp, logits, options))[None, None]
    if options.state_groups == 1:
        return root
    return xp.concat([root] + [xp.zeros_like(root)] * (options.state_groups - 1), axis=0)


def _sampled_classes(xp: Any, p: Any, options: AnalysisOptions, uniforms: Any) -> tuple[Any, Any]:
    """``(K', M, n)`` classes and scales of the ``ggn-topk`` or ``ggn-mc`` signals (a block of
    rows at a time, :data:`LOGIT_BLOCK_ENTRIES`: each row's classes depend on its own
    probabilities and uniforms only)."""
    if uniforms is None:
        raise ValueError(f"{options.estimator} needs the uniforms of normflat.engine.random.sample_uniforms.")
    blocks = _row_blocks(p)
    if blocks is not None:
        parts = [_sampled_classes(xp, p[lo:hi], options, uniforms[lo:hi]) for lo, hi in blocks]
        return xp.concat([i for i, _ in parts], axis=-1), xp.concat([sc for _, sc in parts], axis=-1)
    if options.estimator == "ggn-topk":
        assert options.top_classes is not None
        return _topk_classes(xp, p, uniforms, options.top_classes, options.groups,
                             options.signals_per_group(int(p.shape[-1])))
    return _mc_classes(xp, p, uniforms, options.groups)


def output_signals(xp: Any, logits: Any, options: AnalysisOptions, uniforms: Any = None) -> Any:
    """GGN signals ``(K', M, n, C)`` at the raw logits of one chunk.

    ``Σ_{m} s_{k,m,i} s_{k,m,i}ᵀ`` is, for each sample ``i`` and group ``k``, the
    loss Hessian in the logits (``ggn``: exactly, ``K' = 1``, ``M = C − 1``) or an
    unbiased estimate of it (``ggn-mc``: ``uniforms`` of shape ``(n, samples)``);
    ``ggn-topk``: ``K' = 1 + K``, group 0 the exact part shared by the ``K`` others
    (:func:`topk_signals`). ``M`` is :meth:`AnalysisOptions.signals_per_group`.
    """
    p, zhat, sigma = _probabilities(xp, logits, options)
    if options.estimator == "ggn":
        sig = ggn_factor(xp, p)[None]
    else:
        sig = _class_signals(xp, p, *_sampled_classes(xp, p, options, uniforms))
    if options.loss == "nsce":
        sig = pull_back(xp, sig, zhat, sigma, options.temperature)
    return sig


def pool_signals(xp: Any, signals: Any, options: AnalysisOptions, sequence: bool = False,
                 padding: Any = ()) -> tuple[Any, list[int]]:
    """The signals of :attr:`AnalysisOptions.pooled` sums: one group ``(1, M', ...)``.

    The ``K`` sampled groups ``(K, M, ...)`` become ``K·M`` signals, each scaled by
    ``1/√K``, whose squares sum to the mean of the ``K`` groups' sampled sums (the same
    draws, so the same mean). ``ggn-topk``'s shared group 0 is part of every group
    estimate, so its ``M`` signals join them unscaled: the squares of the ``M + K·M``
    signals sum to the mean of the ``K`` group sums, one sum per weight.

    Args:
        xp: Array namespace.
        signals: ``(K', M, ...)`` signals of :func:`output_signals` or :func:`token_signals`.
        options: The analysis options.
        sequence: The signals are :func:`token_signals`' per-sequence ones
            (:meth:`~normflat.engine.options.AnalysisOptions.sequence_layout`), whose
            shared group 0 is all zeros (:func:`zero_signals`): it is left out.
        padding: The flat indices ``g·M + j`` of ``signals`` known to be zero
            (:func:`padding_signals`).

    Returns:
        ``(signals, padding)``: the pooled signals and the flat indices of those known to be
        zero among them (the empty shared group is not included).
    """
    k = options.groups
    offset = 1 if options.shared_group else 0
    m = int(signals.shape[1])
    rest = tuple(int(d) for d in signals.shape[2:])
    sampled = xp.reshape(signals[offset:], (1, k * m, *rest)) / math.sqrt(k)
    # Pooling keeps the flat order g·M + j (group 0's members first), less the dropped group 0.
    if not offset:
        return sampled, sorted(int(i) for i in padding)
    if zero_signals(options, m, sequence):
        return sampled, sorted(int(i) - m for i in padding if i >= m)
    return xp.concat([signals[:1], sampled], axis=1), sorted(int(i) for i in padding)


def padding_signals(options: AnalysisOptions, num_classes: int, members: tuple[int, int] | None = None,
                    tokens: int = 1, sequence: bool = False) -> list[int]:
    """Flat indices of a block of ``(K', M'', ...)`` signals known to be zero before they are formed.

    The ``(K', M)`` layout is rectangular, its groups are not: ``ggn-topk``'s shared group 0
    holds ``min(k, C)`` exact signals, each sampled group its own draws (``⌈S/K⌉`` or one
    fewer), and a shorter group is padded with zero signals up to ``M``; per-sequence token
    signals also have an all-zero group 0 (:func:`zero_signals`). The real slots are
    :func:`signal_slots`'; the others cost a back-propagation each and add nothing, so a
    backend leaves them out (``top_classes=10`` with the default ``samples=10`` and ``K = 5``
    has ``M = 10``: 20 real signals of 60).

    Args:
        options: The analysis options.
        num_classes: ``C``.
        members: ``(lo, hi)``: the block holds members ``lo .. hi − 1`` of every group
            (:meth:`Factor.members`, ``token_signals(..., members=...)``); ``None``: all ``M``
            (``M'`` of :meth:`~normflat.engine.options.AnalysisOptions.token_signals_per_group`
            per sequence).
        tokens: Per-token signals of a window of ``W = tokens`` tokens
            (:func:`token_signals`): member ``m`` of token ``t`` is signal ``m·W + t``.
        sequence: Per-sequence token signals (``signal_slots(..., sequence=True)``).

    Returns:
        The sorted flat indices ``g·M'' + j`` (``M'' = (hi − lo)·W``) of the block's padding.
    """
    if options.estimator not in ("ggn-mc", "ggn-topk"):
        return []  # the exact ggn and the diagonal signals have no padding
    return [int(i) for i in np.flatnonzero(~_real_mask(options, num_classes, members, tokens, sequence))]


def real_signals(options: AnalysisOptions, num_classes: int, tokens: int = 1, sequence: bool = False) -> np.ndarray:
    """The sorted flat indices of the ``(K', M·W)`` signals that are not padding
    (:func:`padding_signals`' complement over the whole layout; ``tokens`` and ``sequence`` as
    there): what a backend that gathers the signals it back-propagates takes."""
    return np.flatnonzero(_real_mask(options, num_classes, None, tokens, sequence))


def _real_mask(options: AnalysisOptions, num_classes: int, members: tuple[int, int] | None, tokens: int,
               sequence: bool) -> np.ndarray:
    """``(K'·M''·W,)`` flags of a block's real signals, flat ``g·M''·W + (m − lo)·W + t``."""
    if sequence:
        full = options.token_signals_per_group(num_classes, 1)  # independent of the tokens
    else:
        full = options.signals_per_group(num_classes)
    lo, hi = members if members is not None else (0, full)
    real = np.zeros((options.state_groups, hi - lo), dtype=bool)
    for g, j in signal_slots(options, num_classes, sequence=sequence):
        if lo <= j < hi:
            real[g, j - lo] = True
    return np.repeat(real, tokens, axis=1).reshape(-1)  # member m of token t at m·W + t


def zero_signals(options: AnalysisOptions, members: int, sequence: bool = False) -> list[int]:
    """Flat indices ``g·M + j`` of the ``(K', M)`` signals known to be zero before they are formed.

    The shared group 0 of per-sequence ``ggn-topk`` token signals (:func:`token_signals`:
    every top-class signal carries its sampled group's signs), else none; a backend need not
    back-propagate them. (Padding inside the groups is :func:`signal_slots`' business.)
    ``sequence``: the signals are per sequence
    (:meth:`~normflat.engine.options.AnalysisOptions.sequence_layout`).
    """
    if sequence and options.shared_group:
        return list(range(members))
    return []


@dataclass
class Factor:
    """GGN signals in structured form: ``s = scale · e_index + Σ_j coefs_j · vectors_j``.

    Every estimator's signals at the logits are a scaled class indicator plus
    combinations of a few per-sample vectors (``p``; the Householder column ``S v``
    of :func:`ggn_factor`; for ``nsce`` also ``1`` and ``ẑ``). Through a dense head
    ``z = W a`` the signals at its input are then
    ``Wᵀ s = scale · W[index] + Σ_j coefs_j · (Wᵀ vectors_j)``: one row gather per
    signal and one matmul per vector, ``O(C d)`` per sample instead of the ``O(C² d)``
    of pushing ``C − 1`` dense signals through ``W`` (method §6.2).

    Attributes:
        index: ``(K', M, n)`` class of each signal (float; ``-1`` with scale 0: padding).
        scale: ``(K', M, n)``.
        vectors: Per-sample ``(n, C)`` vectors shared by every signal of a sample.
        coefs: ``(K', M, n)`` coefficient of each vector.
    """

    index: Any
    scale: Any
    vectors: list
    coefs: list

    def members(self, start: int, stop: int) -> "Factor":
        """The signals ``start .. stop - 1`` of every group: ``(K', stop - start, n)`` (a backend
        forms and back-propagates a few members of every group at a time; each group's sums add
        up over the slices)."""
        return Factor(self.index[:, start:stop], self.scale[:, start:stop], self.vectors,
                      [w[:, start:stop] for w in self.coefs])

    def dense(self, xp: Any) -> Any:
        """The ``(K', M, n, C)`` signals (for tests and the generic path)."""
        c = int(self.vectors[0].shape[-1])
        classes = xp.astype(_arange_like(xp, c, self.scale), self.scale.dtype)
        out = self.scale[..., None] * xp.astype(self.index[..., None] == classes, self.scale.dtype)
        for v, w in zip(self.vectors, self.coefs):
            out = out + w[..., None] * v[None, None]
        return out

    def through(self, xp: Any, weight: Any, projected: list | None = None) -> Any:
        """``(K', M, n, d)``: the signals pulled back through a dense head of ``(C, d)`` weight.

        ``weight[c]`` is the row of class ``c`` (torch's ``Linear.weight``; a Keras
        ``Dense`` kernel is its transpose). ``projected``: :meth:`projected` of the same
        weight, computed once for several calls (a backend that takes the signals a few at
        a time).
        """
        g, m = int(self.index.shape[0]), int(self.index.shape[1])  # the sample axis may be unknown (-1)
        d = int(weight.shape[-1])
        safe = xp.where(self.index >= 0, self.index, xp.zeros_like(self.index))
        rows = xp.take(weight, xp.reshape(xp.astype(safe, xp.int64), (-1,)), axis=0)
        out = self.scale[..., None] * xp.reshape(rows, (g, m, -1, d))
        for vw, w in zip(self.projected(xp, weight) if projected is None else projected, self.coefs):
            out = out + w[..., None] * vw[None, None]
        return out

    def projected(self, xp: Any, weight: Any) -> list:
        """The shared vectors through the head, ``vectors_j W`` ``(n, d)`` each (:meth:`through`);
        a vector that repeats one row (``nsce``'s vector 1) is multiplied once, as one row."""
        return [xp.broadcast_to(v[:1] @ weight, (int(v.shape[0]), int(weight.shape[-1])))
                if native.repeats_rows(v) else v @ weight for v in self.vectors]


def _gather_rows(xp: Any, table: Any, index: Any) -> Any:
    """``table[i, index[g, m, i]]`` for ``(n, C)`` ``table`` and ``(G, M, n)`` float ``index``
    (``-1`` reads column 0; its scale is 0)."""
    c = int(table.shape[1])
    safe = xp.astype(xp.where(index >= 0, index, xp.zeros_like(index)), xp.int64)
    # Row numbers 0..n-1 without a static n (relaxed tf.function shapes): a running count.
    rows = xp.astype(_cumsum(xp, xp.ones_like(table[:, 0])) - 1, xp.int64)[None, None, :]
    flat = xp.take(xp.reshape(table, (-1,)), xp.reshape(rows * c + safe, (-1,)), axis=0)
    return xp.reshape(flat, (int(index.shape[0]), int(index.shape[1]), -1))


def output_factor(xp: Any, logits: Any, options: AnalysisOptions, uniforms: Any = None) -> Factor:
    """:func:`output_signals` of ``(n, C)`` logits as a :class:`Factor` (``Factor.dense`` equals it).

    ``ggn``: column ``j < C − 1`` of ``S R`` is ``√p_j (e_j − p) − (2/|v|²) v_j (S v)``
    (:func:`ggn_factor`); ``ggn-mc`` / ``ggn-topk``: ``scale (e_c − p)``; ``nsce`` pulls
    every signal back with ``Jᵀ s = (τ/σ)(s − s̄ − ẑ (ẑ·s)/C)``, which adds the vectors
    ``1`` and ``ẑ``.
    """
    c = int(logits.shape[-1])
    p, zhat, sigma = _probabilities(xp, logits, options)
    if options.estimator == "ggn":
        root, v, sv, alpha = _householder(xp, p)  # alpha: (n,)
        first = _permute(xp, root[:, : c - 1], (1, 0))[None]  # (1, C-1, n)
        index = xp.astype(_arange_like(xp, c - 1, p), p.dtype)[None, :, None] + xp.zeros_like(first)
        scale = first
        vectors = [p, sv]
        coefs = [-first, -alpha[None, None, :] * _permute(xp, v[:, : c - 1], (1, 0))[None]]
    else:
        index, scale = _sampled_classes(xp, p, options, uniforms)
        vectors, coefs = [p], [-scale]
    return _pulled_back(xp, Factor(index, scale, vectors, coefs), zhat, sigma, options)


def _pulled_back(xp: Any, factor: Factor, zhat: Any, sigma: Any, options: AnalysisOptions) -> Factor:
    """``factor``'s signals in the normalized logits pulled back to the raw ones (``nsce``:
    :func:`pull_back`, which adds the vectors ``1`` and ``ẑ``); ``ce``: ``factor`` itself."""
    if options.loss != "nsce":
        return factor
    index, scale, vectors, coefs = factor.index, factor.scale, factor.vectors, factor.coefs
    c = int(zhat.shape[-1])
    a = (options.temperature / sigma)[:, 0]  # (n,)
    total = scale + sum(w * xp.sum(v, axis=-1)[None, None] for v, w in zip(vectors, coefs))
    dot = scale * _gather_rows(xp, zhat, index) + sum(
        w * _row_dots(xp, v, zhat)[None, None] for v, w in zip(vectors, coefs))
    scale = a * scale
    coefs = [a * w for w in coefs] + [-a * total / c, -a * dot / c]
    # The vector 1: a broadcast view of one row where the library has views (numpy, torch),
    # not one more array of the logits' size.
    ones = (xp.broadcast_to(xp.ones_like(zhat[:1]), zhat.shape) if native.mutable(zhat)
            else xp.ones_like(zhat))
    vectors = vectors + [ones, zhat]
    return Factor(index, scale, vectors, coefs)


def sequence_factor(xp: Any, logits: Any, options: AnalysisOptions, counted: Any, uniforms: Any) -> Factor:
    """The per-sequence signals of :func:`token_signals` as a :class:`Factor` over the ``n·T``
    token rows: ``Factor.dense`` reshaped to ``(K', M', n, T, C)`` equals them.

    Every signal of a sequence is, at each token, that token's signed class signal
    (:func:`sequence_classes`), so through a dense head applied token by token its rows are
    ``scale · W[index] + Σ_j coefs_j · (vectors_j W)``: ``O(d)`` per signal and token after one
    ``(n·T, C) × (C, d)`` product per vector, instead of forming the ``(K', M', n, T, C)``
    signals and pushing them through the head (method §6.2, §6.3).
    """
    return classes_factor(xp, sequence_classes(xp, logits, options, counted, uniforms), options)


def classes_factor(xp: Any, classes: "SequenceClasses", options: AnalysisOptions) -> Factor:
    """The per-sequence signals of :class:`SequenceClasses` as a :class:`Factor` (those of
    :func:`sequence_factor`, from classes found in any way: a backend may find them a block of
    tokens at a time)."""
    factor = Factor(classes.index, classes.scale, [classes.p], [-classes.scale])
    return _pulled_back(xp, factor, classes.zhat, classes.sigma, options)


def token_signals(xp: Any, logits: Any, options: AnalysisOptions, counted: Any, uniforms: Any = None,
                  tokens: tuple[int, int] | None = None, diagonal: bool = False,
                  members: tuple[int, int] | None = None) -> Any:
    """GGN signals ``(K', M', n, T, C)`` of token logits ``(n, T, C)`` (method §6.3).

    The loss Hessian of one sequence is block-diagonal over its tokens. **Per token**
    (the exact ``ggn``, or ``sequence_signals=False``): its factor is the per-token
    factor of :func:`output_signals` placed at one token, ``M' = M·W``: signal ``m·W + j``
    is the ``m``-th signal of token ``lo + j`` at position ``lo + j`` and zero elsewhere.
    **Per sequence** (:attr:`~normflat.engine.options.AnalysisOptions.per_sequence`,
    ``M'`` of :meth:`~normflat.engine.options.AnalysisOptions.token_signals_per_group`):
    a signal is the sum over the tokens of one per-token signal each, times an
    independent sign ``ε_t = ±1``: the square of its gradient is the sum of the tokens'
    squares plus cross terms ``ε_t ε_t' g_t g_t'`` of mean zero, one back-propagation for
    the whole sequence. ``ggn-mc``'s per-token signals ``(e_ỹ − p)/√m`` already have mean
    zero and independent draws, so they are summed as they are; ``ggn-topk``'s sampled
    group ``g`` holds the top-class signals and its draws, each with its own signs from
    the uniforms' sign columns (so the groups are independent), and the shared group 0
    is zero (the exact part is no longer exact once signed). Tokens not counted
    (``counted`` is 0) carry zero signals.

    Args:
        xp: Array namespace.
        logits: ``(n, T, C)`` token logits.
        options: The analysis options.
        counted: ``(n, T)`` 1 for counted tokens, 0 for ignored ones (logits' dtype).
        uniforms: ``ggn-mc``/``ggn-topk``: ``(n, T·D)`` uniforms
            (:meth:`~normflat.engine.options.AnalysisOptions.uniform_columns`), token ``t``
            taking columns ``t·D .. (t+1)·D − 1``: its ``S`` class draws, then (per-sequence
            ``ggn-topk``) one sign column per sampled group and member, ``g·(k + ⌈S/K⌉) + j``
            for top-class signal ``j`` and ``g·(k + ⌈S/K⌉) + k + j`` for draw ``j``
            (``k = top_classes``), the sign ``+1`` below 1/2.
        tokens: Per token only: ``(lo, hi)``: only the signals of tokens ``lo .. hi − 1``
            (``W = hi − lo``), so that a backend can bound memory by taking a few tokens at a
            time; ``None``: every token (``W = T``). Each token's signals depend on its own
            logits and uniforms only, so the blocks together are the whole factor.
        diagonal: Place :func:`diagonal_signals` (``M = 1``) per token instead, for a layer
            whose output is the logits (always per token: its squares are exact).
        members: Per sequence only: ``(lo, hi)``: only members ``lo .. hi − 1`` of every group
            (``M' = hi − lo``), from the same draws and signs, so that a backend can bound the
            signals formed at once; the blocks together are the whole set. ``None``: all.
    """
    # The sample axis may be unknown while tracing (tf.function with relaxed shapes): -1 below.
    t, c = int(logits.shape[1]), int(logits.shape[2])
    if options.per_sequence and not diagonal:
        if tokens is not None and tuple(tokens) != (0, t):
            raise ValueError("per-sequence token signals are formed for all tokens at once (tokens=None)")
        return _sequence_signals(xp, logits, options, counted, uniforms, members)
    if members is not None:
        raise ValueError("members selects per-sequence token signals; per token, select tokens")
    lo, hi = tokens if tokens is not None else (0, t)
    w = hi - lo
    rows = xp.reshape(logits[:, lo:hi], (-1, c))  # (n·W, C)
    if uniforms is not None:
        draws = int(uniforms.shape[1]) // t
        uniforms = xp.reshape(uniforms[:, lo * draws:hi * draws], (-1, draws))[:, :options.draws]
    sig = diagonal_signals(xp, rows, options) if diagonal else output_signals(xp, rows, options, uniforms)
    k, m = int(sig.shape[0]), int(sig.shape[1])
    sig = xp.reshape(sig, (k, m, -1, w, c)) * counted[None, None, :, lo:hi, None]
    sig = _permute(xp, sig, (0, 1, 3, 2, 4))  # (K, M, W, n, C)
    place = xp.astype(_arange_like(xp, w, logits)[:, None] + lo == _arange_like(xp, t, logits)[None, :],
                      logits.dtype)  # (W, T): token lo + j sits at position lo + j
    placed = sig[:, :, :, :, None, :] * place[None, None, :, None, :, None]  # (K, M, W, n, T, C)
    return xp.reshape(placed, (k, m * w, -1, t, c))


class SequenceClasses(NamedTuple):
    """The per-sequence signals of :func:`token_signals` before they are formed (method §6.3).

    Signal ``(g, m)`` at token row ``r`` (``n·T`` rows, token-major within each sample) is
    ``scale[g, m, r] · (e_index[g, m, r] − p_r)``, pulled back through the normalization for
    ``nsce``: the signs and the counted tokens are in ``scale`` (index ``-1`` with scale 0 is a
    zero, padding signal). ``index`` and ``scale`` are ``(K', M', n·T)``, a few numbers per token
    and signal: a backend picks any signals from them and forms only those
    (:func:`sequence_dense`), ``O(T·C)`` each, instead of the whole ``(K', M', n, T, C)`` tensor.
    """

    p: Any  #: ``(n·T, C)`` softmax probabilities of the (normalized) logits.
    zhat: Any  #: ``nsce``: ``(n·T, C)`` normalized logits ẑ of :func:`normalize_logits`; else None.
    sigma: Any  #: ``nsce``: ``(n·T, 1)`` their scales σ; else None.
    index: Any  #: ``(K', M', n·T)`` the class of each (signal, token) pair, ``-1`` for none.
    scale: Any  #: ``(K', M', n·T)`` its scale (sign, draw weight and counted-token mask included).


def sequence_classes(xp: Any, logits: Any, options: AnalysisOptions, counted: Any, uniforms: Any) -> SequenceClasses:
    """The :class:`SequenceClasses` of the per-sequence signals of token logits ``(n, T, C)``.

    Args: as :func:`token_signals` (per sequence: :meth:`~normflat.engine.options.AnalysisOptions.sequence_layout`).
    """
    t, c = int(logits.shape[1]), int(logits.shape[2])
    rows = xp.reshape(logits, (-1, c))  # (n·T, C)
    columns = int(uniforms.shape[1]) // t
    u = xp.reshape(uniforms, (-1, columns))  # (n·T, D): token rows, as rows
    s = options.draws
    p, zhat, sigma = _probabilities(xp, rows, options)
    index, scale = _sampled_classes(xp, p, options, u[:, :s])  # (K', M, n·T), per token
    if options.estimator == "ggn-topk":
        assert options.top_classes is not None
        groups, k = options.groups, options.top_classes
        top, draws = min(k, c), -(-s // groups)
        stride = k + draws
        signs = xp.where(u[:, s:] < 0.5, xp.ones_like(u[:, s:]), -xp.ones_like(u[:, s:]))  # (n·T, K·stride)
        signs = _permute(xp, xp.reshape(signs, (-1, groups, stride)), (1, 2, 0))  # (K, stride, n·T)
        signs = xp.concat([signs[:, :top], signs[:, k:k + draws]], axis=1)  # (K, top + draws, n·T)
        # Every sampled group holds its own signed copy of the top-class signals, then its draws;
        # the shared group 0 holds nothing (scale 0, class -1: a padding signal).
        body_index = xp.concat([xp.concat([index[:1, :top]] * groups, axis=0), index[1:, :draws]], axis=1)
        body_scale = xp.concat([xp.concat([scale[:1, :top]] * groups, axis=0), scale[1:, :draws]], axis=1) * signs
        index = xp.concat([body_index[:1] * 0 - 1, body_index], axis=0)
        scale = xp.concat([body_scale[:1] * 0, body_scale], axis=0)
    scale = scale * xp.reshape(counted, (-1,))[None, None, :]  # uncounted tokens: zero signals
    return SequenceClasses(p, zhat, sigma, index, scale)


def sequence_dense(xp: Any, classes: SequenceClasses, options: AnalysisOptions, index: Any = None,
                   scale: Any = None) -> Any:
    """``(A, B, n·T, C)`` dense signals of :class:`SequenceClasses` (token rows as rows).

    ``index`` and ``scale``: ``(A, B, n·T)`` picked from ``classes.index`` and
    ``classes.scale`` (any selection of signals, e.g. a step of them; ``-1`` and 0 for a
    padding signal), or ``None``: all ``(K', M')`` signals.
    """
    if index is None:
        index, scale = classes.index, classes.scale
    sig = _class_signals(xp, classes.p, index, scale)
    if options.loss == "nsce":
        sig = pull_back(xp, sig, classes.zhat, classes.sigma, options.temperature)
    return sig


def _sequence_signals(xp: Any, logits: Any, options: AnalysisOptions, counted: Any, uniforms: Any,
                      members: tuple[int, int] | None = None) -> Any:
    """The per-sequence signals ``(K', M', n, T, C)`` of :func:`token_signals` (members
    ``lo .. hi − 1`` of every group when ``members`` is given).

    The signs and the counted tokens scale the per-token classes' scales ``(K', M', n·T)``
    (:func:`sequence_classes`) before the dense signals are formed once (the largest array of
    a language model's analysis: no stacked or signed copies of it).
    """
    classes = sequence_classes(xp, logits, options, counted, uniforms)
    return sequence_members(xp, classes, options, int(logits.shape[1]), members)


def sequence_members(xp: Any, classes: SequenceClasses, options: AnalysisOptions, tokens: int,
                     members: tuple[int, int] | None = None) -> Any:
    """``(K', M', n, T, C)``: members ``lo .. hi − 1`` of every group (all when ``members`` is
    ``None``) of the per-sequence signals of :class:`SequenceClasses` of ``T = tokens`` tokens,
    dense (a backend that forms a few members at a time finds the classes once)."""
    index, scale = classes.index, classes.scale
    if members is not None:
        index, scale = index[:, members[0]:members[1]], scale[:, members[0]:members[1]]
    sig = sequence_dense(xp, classes, options, index, scale)
    k2, m = int(sig.shape[0]), int(sig.shape[1])
    return xp.reshape(sig, (k2, m, -1, int(tokens), int(classes.p.shape[-1])))


#: Length of :func:`logit_stats`' vector.
LOGIT_STATS = 7

#: Entries of :func:`logit_stats` combined over blocks of rows by their least value (the
#: others by their largest).
_LEAST_STATS = (0, 1, 3, 5, 6)


def logit_stats(xp: Any, logits: Any) -> Any:
    """:data:`LOGIT_STATS` numbers summarizing ``(n, C)`` logits for :func:`check_logit_stats`.

    Computable inside compiled code (one small array, checked on the host later):
    ``[all finite, min entry, max |row sum − 1|, min row RMS of the centred logits,
    max |entry|, min top-two gap, min top-two gap / row RMS]``. The gap of a row is its
    largest logit less the next one (0 for a tie); the last entry is that gap in units of
    the normalized logits of ``nsce``. Where arrays are mutable, many rows are summarized a
    block at a time (:data:`LOGIT_BLOCK_ENTRIES`) and the blocks' numbers combined.
    """
    rows = xp.reshape(logits, (-1, int(logits.shape[-1]))) if len(logits.shape) > 2 else logits
    blocks = _row_blocks(rows)
    if blocks is not None:
        return combined_logit_stats(xp, [logit_stats(xp, rows[lo:hi]) for lo, hi in blocks])
    finite = xp.astype(xp.all(xp.isfinite(logits)), logits.dtype)
    safe = xp.where(xp.isfinite(logits), logits, xp.zeros_like(logits))
    zc = safe - xp.mean(safe, axis=-1, keepdims=True)
    m = xp.max(xp.abs(zc), axis=-1, keepdims=True)
    m1 = xp.where(m > 0, m, xp.ones_like(m))
    rms = m1 * xp.sqrt(xp.mean((zc / m1) ** 2, axis=-1, keepdims=True))
    rms = xp.where(m > 0, rms, xp.zeros_like(rms))
    # The runner-up: the top entries replaced by the row's least (no infinity needed); a tie
    # for the top leaves the others, so its gap is set to 0 by the count of top entries.
    top = xp.max(zc, axis=-1, keepdims=True)
    is_top = zc == top
    runner_up = xp.max(xp.where(is_top, xp.min(zc, axis=-1, keepdims=True), zc), axis=-1, keepdims=True)
    single = xp.sum(xp.astype(is_top, zc.dtype), axis=-1, keepdims=True) == 1
    gap = xp.where(single, top - runner_up, xp.zeros_like(top))
    scaled = xp.where(rms > 0, gap / xp.where(rms > 0, rms, xp.ones_like(rms)), xp.zeros_like(gap))
    return xp.stack([
        finite,
        xp.min(safe),
        xp.max(xp.abs(xp.sum(safe, axis=-1) - 1)),
        xp.min(rms),
        xp.max(xp.abs(safe)),
        xp.min(gap),
        xp.min(scaled),
    ])


def combined_logit_stats(xp: Any, parts: list) -> Any:
    """The :func:`logit_stats` of rows taken in blocks, from each block's: the least of the
    finite flags, minima, RMS and gaps, the largest of the row-sum and magnitude maxima."""
    stacked = xp.stack(parts)  # (blocks, LOGIT_STATS)
    low, high = xp.min(stacked, axis=0), xp.max(stacked, axis=0)
    return xp.stack([low[i] if i in _LEAST_STATS else high[i] for i in range(LOGIT_STATS)])


def check_logit_stats(stats: Any, options: AnalysisOptions, index: int, num_classes: int,
                      dtype_eps: float) -> float:
    """Raise the one error every framework gives for unusable logits; return how saturated
    the softmax of the batch is.

    Args:
        stats: :func:`logit_stats` of a batch (any array type; read on the host).
        options: The analysis options.
        index: Batch index for the message.
        num_classes: ``C``.
        dtype_eps: Machine epsilon of the logits' dtype (``numpy.finfo(dtype).eps``).

    Returns:
        :func:`softmax_saturation` of the batch: ``>= 0`` when every row's softmax is
        saturated (the loss has no curvature there), ``-inf`` for a custom loss.

    Raises:
        ValueError: For NaN/inf logits; for probabilities given as logits (built-in
            losses); for constant logits with ``nsce``.
    """
    values = np.asarray(stats, dtype=np.float64).reshape(-1)
    finite, lo, row_dev, min_rms, max_abs = (float(v) for v in values[:5])
    if not finite:
        raise ValueError(
            f"Batch {index}: the model's logits contain NaN or infinite values; check the weights "
            "(a diverged training run?) and the inputs."
        )
    if callable(options.loss):
        return -math.inf
    if lo >= 0 and row_dev <= max(1e-6, 8 * num_classes * dtype_eps):
        raise ValueError(
            f"Batch {index}: the model's outputs are non-negative rows that sum to 1, i.e. "
            f"probabilities, but loss={options.loss!r} takes logits (it applies the softmax itself). "
            "Remove the final softmax from the model (return the pre-softmax scores), or pass a "
            "custom loss callable with estimator='exact' or 'hutchinson'."
        )
    if options.loss == "nsce" and min_rms <= max(CONSTANT_LOGITS_RMS, 64 * dtype_eps * max_abs):
        raise ValueError(
            f"Batch {index}: the model's logits are (nearly) equal across classes for some sample "
            f"(RMS of the centred logits {min_rms:.3g}), e.g. a zero-initialized output layer. The "
            "normalized softmax cross-entropy divides by that RMS, so its curvature there is of order "
            "1/ε and the measures would be meaningless. Analyze a trained model, or pass loss='ce'."
        )
    return softmax_saturation(values, options, num_classes, dtype_eps)


def softmax_saturation(stats: Any, options: AnalysisOptions, num_classes: int, dtype_eps: float) -> float:
    """How far past saturation the softmax of every row of a batch is (method §7).

    A row whose top logit exceeds the next by ``g`` has ``1 − p_top ≤ (C − 1) e^{−g}``
    (``g`` of the logits the softmax takes: ``τ`` times the normalized gap for ``nsce``).
    When that bound is below the dtype's ``ε`` for every row, ``p_top`` rounds to 1 and the
    loss has (numerically) no curvature at any sample: the measures are then ≈ 0 because
    the model is saturated, not flat.

    Returns:
        ``min g − log((C − 1) / ε)``: ``>= 0`` when every row is saturated; ``-inf`` for a
        custom loss or one class.
    """
    values = np.asarray(stats, dtype=np.float64).reshape(-1)
    if callable(options.loss) or num_classes < 2:
        return -math.inf
    gap = options.temperature * values[6] if options.loss == "nsce" else values[5]
    return float(gap - math.log((num_classes - 1) / dtype_eps))


def saturation_warning(saturation: float, options: AnalysisOptions) -> str | None:
    """The warning for an analysis whose every counted row had a saturated softmax
    (:func:`softmax_saturation` ``>= 0`` over all batches and ranks), else ``None``."""
    if not saturation >= 0 or math.isinf(saturation):
        return None
    fix = ("pass loss='nsce' (it normalizes the logits)" if options.loss == "ce"
           else "pass a smaller temperature")
    return (
        "The softmax is saturated on every sample: each one's top class has probability 1 to "
        "within the float precision, so the loss has (numerically) no curvature and the Hessian "
        "trace and normalized sharpness are ≈ 0 because the model is over-confident, not because "
        "its minimum is flat. Check the inputs' scale (e.g. raw 0–255 pixels fed to a model "
        f"trained on [0, 1]), or {fix} (method §7, a saturated softmax)."
    )


def namespace_check(xp: Any) -> list[str]:
    """Names of the functions this module needs that ``xp`` lacks (empty when usable)."""
    need = ("mean", "sum", "max", "min", "abs", "sqrt", "exp", "log", "where", "arange", "astype",
            "stack", "concat", "reshape", "zeros_like", "ones_like", "isfinite", "all")
    missing = [n for n in need if not hasattr(xp, n)]
    if not (hasattr(xp, "permute_dims") or hasattr(xp, "transpose")):
        missing.append("permute_dims")
    if not (hasattr(xp, "cumulative_sum") or hasattr(xp, "cumsum")):
        missing.append("cumulative_sum")
    return missing


def check_output_shape(shape: tuple[int, ...], options: AnalysisOptions, index: int, n: int,
                       seen: tuple[int | None, ...] | None = None,
                       other_rows: Callable[[], tuple[int | None, ...]] | None = None) -> int:
    """Check the model's output shape ``(n, C)`` or ``(n, T, C)`` (token logits); return ``C``.

    Args:
        shape: The logits' shape of this call of the model.
        options: The analysis options (the loss).
        index: The batch index, for the messages.
        n: The samples the model was called on.
        seen: The logits' shape of an earlier call of the model in this analysis (``None`` for
            the first): the number of classes must be the same (:func:`check_same_classes`).
        other_rows: The logits' shape of the model called on its first row alone, asked only
            before refusing a number of classes (a single output unit, or 2 classes with
            ``nsce``) for ``n >= 2``: few classes may be as many as the rows, scores against
            in-batch candidates, whose own error is then the one raised (:func:`classes_first`).

    Raises:
        ValueError: For outputs that are neither ``(batch, classes)`` nor
            ``(batch, tokens, classes)`` logits, for a number of classes that differs from
            ``seen``'s (:func:`check_same_classes`), and for a single output unit with a
            built-in loss or 2 classes with ``nsce``.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"Batch {index}: the model's output has shape {shape}; normflat needs logits of shape "
            "(batch, classes), or token logits (batch, tokens, classes) with token labels (batch, tokens). "
            "Flatten or pool extra axes in the model, or wrap it; per-pixel logits (batch, H, W, classes) "
            "of a segmenter are token logits once reshaped to (batch, H·W, classes) by a callable output=... "
            "on the model's output, with labels (batch, H·W)."
        )
    if shape[0] != n:
        raise ValueError(f"Batch {index}: the model returned {shape[0]} rows of logits for {n} samples.")
    check_same_classes(shape, seen)
    c = shape[-1]
    with classes_first(shape, other_rows):
        if c < 2 and not callable(options.loss):
            raise ValueError(
                f"The model has a single output unit (logits of shape {shape}); the built-in losses are the "
                "softmax cross-entropy over at least 2 classes, for which one logit carries no curvature "
                "(the measures would be 0). For a binary classifier return two logits, e.g. [0, z] "
                "(torch.cat([torch.zeros_like(z), z], 1)), which is the same model as a sigmoid, with "
                "loss='ce'; or pass "
                "a custom loss callable with estimator='exact' or 'hutchinson'."
            )
        if c == 2 and options.loss == "nsce":
            # Two centred logits are (d/2, -d/2): normalized they are always (+τ, -τ) or (-τ, +τ), so
            # the normalized loss is piecewise constant in the weights and every measure would be 0.
            raise ValueError(
                f"The model has 2 classes (logits of shape {shape}); with two classes the normalized logits "
                "of loss='nsce' are always ±temperature, so that loss does not change with the weights and "
                "every measure would be 0. Pass loss='ce' for a binary classifier."
            )
    return c


@contextlib.contextmanager
def classes_first(seen: tuple[int | None, ...] | None,
                  other_rows: Callable[[], tuple[int | None, ...]] | None) -> Iterator[None]:
    """Checks worded for a classifier whose refusal first asks whether the model mixes the samples.

    The first call of the model in an analysis has nothing to be compared with
    (:func:`check_same_classes`), and its few "classes" may be the rows of scores against in-batch
    candidates: a refusal of their number (one output unit, 2 classes with ``nsce``) or of labels
    outside their range would name the wrong cause. So before a ``ValueError`` of the block leaves,
    the logits of the model called on other rows (``other_rows()``, one row) are compared with
    ``seen``, and logits whose classes follow the rows get their own error. Only on this path to
    an error: a valid model never pays the call.

    Args:
        seen: The logits' shape of the model's first call (at least 2 rows, else nothing to compare).
        other_rows: The logits' shape of the model called on its first row alone (``None``: no
            comparison). If it fails, the block's refusal stands.
    """
    try:
        yield
        return
    except ValueError as err:
        refusal = err
    if other_rows is not None and seen is not None and len(seen) >= 2 and seen[0] is not None and seen[0] >= 2:
        try:
            other = other_rows()
        except Exception:  # noqa: BLE001 - a diagnosis only: the refusal stands
            other = None
        try:
            check_same_classes(other, seen)
        except ValueError as mixed:
            raise mixed from None  # the cause, not shown as raised while handling the refusal it replaces
    raise refusal


def check_same_classes(shape: tuple[int | None, ...] | None, seen: tuple[int | None, ...] | None) -> None:
    """Raise the one error every framework gives for logits whose number of classes follows the rows.

    The measures need every sample's logits from that sample alone (method §6: per-sample
    gradients of the logits). Scores against in-batch candidates, as a contrastive model's
    ``logits_per_image`` of shape ``(n, n)``, have as many "classes" as the rows the model is
    called on, and each sample's depend on the others; a per-batch check of the shape cannot
    tell them from a classifier's. What tells them apart: a classifier has the same number of
    classes (the last axis) on every call. So the backends compare every call of the model
    within an analysis with the first: the probe of the first rows, every chunk and batch, the
    one-sample forwards of PyTorch's generic path, JAX's per-example trace with an abstract call
    on two rows, the shapes Keras' compiled steps are traced with. A batch of one row, or
    chunks that all have as many rows as the first call, cannot reveal it.

    Args:
        shape: The logits' shape of this call, rows first, classes last; an axis may be
            ``None`` in a trace for any number of rows (Keras' steps), where a class axis left
            open follows the rows. ``None``: nothing to compare.
        seen: The logits' shape of an earlier call of the model in the same analysis (``None``:
            the first call, nothing to compare).

    Raises:
        ValueError: If the last axes differ.
    """
    if shape is None or seen is None or len(shape) < 2 or len(seen) < 2:
        return  # a scalar or a vector is check_output_shape's error
    shape, seen = (tuple(None if d is None else int(d) for d in s) for s in (shape, seen))
    if shape[-1] == seen[-1]:
        return

    def samples(rows: int | None) -> str:
        return "a batch of any size" if rows is None else f"{rows} sample{'' if rows == 1 else 's'}"

    raise ValueError(
        f"The model's logits have shape {shape} for {samples(shape[0])} but {seen} for {samples(seen[0])}: "
        "their number of classes (the last axis) follows the number of samples the model is called on, so "
        "each sample's logits depend on the other samples (scores against in-batch candidates, as a "
        "contrastive model's logits_per_image). The measures need every sample's logits from that sample "
        "alone: analyze a classifier on the model's per-sample outputs (e.g. its embeddings followed by a "
        "classification head), or make the model return each sample's logits computed from that sample alone."
    )


#: The rows of the first batch whose logits the backends also compute one row at a time
#: (:func:`check_samples_apart`): the first two, as the probe of the first forward.
SAMPLES_APART_ROWS = 2


#: Machine epsilon of the floating dtypes logits are computed in, by name (numpy has no bfloat16).
_EPS_BY_NAME = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps),
                "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0 ** -7}


def samples_apart_tolerance(dtype: str) -> float:
    """The relative difference :func:`check_samples_apart` accepts between a row's logits computed
    alone and with the other rows: ``16·√ε`` of the dtype the logits were computed in (float64
    2.4e-7, float32 5.5e-3), at most 0.1 (float16 and bfloat16).

    Batched and one-row forwards may round differently (other matrix-product blockings and
    convolution algorithms for other batch sizes), by far less than that; a model that mixes its
    samples moves the logits by their own order of magnitude.

    Args:
        dtype: The dtype's name (``"float32"``, ``"bfloat16"``, ...); another name counts as float32.
    """
    eps = _EPS_BY_NAME.get(str(dtype).rsplit(".", 1)[-1], _EPS_BY_NAME["float32"])
    return min(16.0 * math.sqrt(eps), 0.1)


def check_samples_apart(together: Any, alone: list[Any], dtype: str | None = None) -> None:
    """Raise the one error every framework gives for a model whose logits of one sample depend on
    the other samples of its batch.

    The measures are per sample (method §6: every sample's per-sample gradients of its own
    logits). Every framework forms them its own way: PyTorch's and Keras' fast rules from the
    batch's activations, their generic paths and JAX from each sample run alone. A model that
    mixes the samples (statistics over the batch axis, as an explicit mean over the samples or a
    batch normalization that ignores inference mode; attention across the samples) has no
    per-sample curvature, and each of those ways would give its own number without an error.
    Its logits for a sample
    alone differ from those in a batch, which :func:`check_same_classes` does not see when the
    number of classes stays. So every backend computes the first rows of the first batch
    (:data:`SAMPLES_APART_ROWS`) together and each alone, once per analysis (per traced structure
    in JAX, per model and input signature in Keras' cached probe), and hands them here. A first
    batch of one row, or first rows that are equal, cannot reveal it; a model that cannot run on
    one row is not compared (PyTorch and Keras: their generic paths refuse it with
    :func:`one_sample_error`), nor is one that cannot run on two (JAX: the analysis runs it per
    example only).

    Args:
        together: ``(r, *out)`` host array: the logits of the first ``r`` rows from one forward
            (of those rows, or of a whole batch).
        alone: ``r`` host arrays ``(1, *out)`` (or ``out``): each row's logits from a forward of
            that row alone. A shape other than the row's (token logits trimmed to a row's own
            length) is not compared.
        dtype: The name of the dtype the logits were computed in, where it is narrower than
            ``together``'s (a mixed-precision model's float32 logits of a bfloat16 computation);
            ``None``: ``together``'s.

    Raises:
        ValueError: If a row's logits alone differ from its logits together by more than
            :func:`samples_apart_tolerance` of the larger logit of the two, each prediction's
            logits centred first (a common shift changes no probability: mixing that only
            shifts them is harmless, and a large common offset would hide the rest); finite
            values only (non-finite logits are :func:`check_logit_stats`' error).
    """
    together = np.asarray(together)
    tol = samples_apart_tolerance(dtype if dtype is not None else together.dtype.name)

    for i, one in enumerate(alone):
        row = together[i].astype(np.float64)
        if np.size(one) != row.size:
            continue
        one = np.asarray(one, dtype=np.float64).reshape(row.shape)
        finite = np.isfinite(row) & np.isfinite(one)
        if not finite.any():
            continue
        if row.ndim >= 1 and row.shape[-1] > 1:
            # A shift of all of a prediction's logits changes no probability and no loss: each
            # prediction's logits are centred (over the entries finite in both) before comparing.
            count = np.maximum(finite.sum(-1, keepdims=True), 1)
            row = row - np.where(finite, row, 0.0).sum(-1, keepdims=True) / count
            one = one - np.where(finite, one, 0.0).sum(-1, keepdims=True) / count
        row, one, finite = row.reshape(-1), one.reshape(-1), finite.reshape(-1)
        scale = float(max(np.abs(row[finite]).max(), np.abs(one[finite]).max()))
        diff = float(np.abs(row[finite] - one[finite]).max())
        if diff > tol * scale:
            raise ValueError(
                f"The model's logits of a sample depend on the other samples of its batch: row {i} of the "
                f"first batch gives logits that differ by up to {diff:.3g} (the largest logit is {scale:.3g}, "
                "each prediction's logits centred) when it runs alone and when it runs in a batch with other "
                "rows. The measures are per sample (each sample's curvature from its own logits), so a model "
                "that mixes the samples has none to measure: statistics over the batch axis (a mean or a "
                "normalization over the samples in the forward pass, a batch normalization that ignores "
                "inference mode), attention or message passing across the samples, or a forward that is "
                "random in inference mode. Make each sample's "
                "output depend on that sample only (e.g. use running statistics, apply the batch-level step "
                "outside the model), or analyze the per-sample part of the model."
            )


#: Removed from a quoted error: terminal escapes (Keras prints parts of its errors in bold) and
#: TensorFlow's names of the failing op's function and kernel.
_ESCAPES = re.compile(r"\x1b\[[0-9;]*m|\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]")

#: Lines of a framework's error that locate it rather than say it: TensorFlow's graph execution
#: errors ("Graph execution error:", "Detected at node … defined at (most recent call last):", the
#: Python frames of the node's creation, "[[{{node …}}]]").
_LOCATING_LINES = re.compile(r"Graph execution error:$|Detected at node .* defined at \(most recent call last\):$"
                             r"|File \"[^\"]*\", line \d+, in |\[\[\{\{node ")

#: Where a quoted error's useful part ends: Keras appends the arguments of the failing call.
_QUOTE_ENDS = ("Arguments received by",)

#: Characters of a framework's error quoted in a message (the whole error is chained).
_QUOTE_CHARS = 400


def quoted_error(error: BaseException) -> str:
    """``error`` as one line for a message: its type and text, terminal escapes, Keras' wrapper
    line ("Exception encountered when calling …") and arguments, and TensorFlow's graph locations
    (the node and the Python frames that created it) removed, cut to a few hundred characters (the
    error itself is chained)."""
    lines = []
    for line in _ESCAPES.sub("", str(error)).splitlines():
        line = line.strip()
        if line.startswith(_QUOTE_ENDS):
            break
        if line and not line.startswith("Exception encountered when calling") and not _LOCATING_LINES.match(line):
            lines.append(line)
    text = " ".join(lines) or "no message"
    if len(text) > _QUOTE_CHARS:
        text = text[:_QUOTE_CHARS].rstrip() + " …"
    return f"{type(error).__name__}: {text}"


def one_sample_error(framework: str, error: BaseException, weights: list[str] | None = None,
                     fast: bool = True) -> ValueError:
    """The one error every framework gives for a model that runs on its batches but fails on one
    sample alone, where the analysis computes per-sample gradients from each sample's own forward.

    Per-sample gradients (method §6, "Samples apart") come from the batch's activations (the fast
    rules of PyTorch and Keras) or from a forward of each sample alone (their generic paths, and
    every weight in JAX, which traces the model per example). A forward written for more than one
    sample (a fixed batch size in a reshape, ``squeeze()`` without an axis dropping the batch axis
    of one sample) fails there with the framework's own error from deep inside the analysis; each
    backend catches it where it first calls the model on one sample and raises this instead, the
    framework's error chained.

    Args:
        framework: ``"torch"``, ``"keras"`` or ``"jax"``, for the message.
        error: The framework's error from the forward of one sample.
        weights: The weights whose curvature comes from per-sample forwards (PyTorch and Keras: those
            on the generic path), named in the message; ``None``: every weight (JAX).
        fast: The ``fast`` option (``False`` sends every weight to the generic path).

    Returns:
        The ``ValueError`` to raise (``raise one_sample_error(...) from error``).
    """
    if weights is None:
        which = "every weight's curvature (the JAX backend traces the model per example)"
    elif not fast:
        which = "every weight's curvature (fast=False: every weight on the generic path)"
    else:
        shown = ", ".join(weights[:5]) + (f" and {len(weights) - 5} more" if len(weights) > 5 else "")
        which = f"the curvature of the weights that no fast rule reads ({shown}: the generic path)"
    how = ("Make the model's forward accept a batch of one sample"
           + (", or analyze with fast=True where every weight has a fast rule." if weights is not None and not fast
              else "."))
    return ValueError(
        f"The {framework} model runs on its batches but fails when called on one sample alone "
        f"({quoted_error(error)}). normflat computes {which} from a forward of each sample alone (method §6, "
        "\"Samples apart\"), so the forward must also run on a batch of one sample: no fixed batch size "
        "(a reshape to (2, -1, ...) or to the training batch size) and no squeeze of the batch axis "
        f"(squeeze() without an axis turns one sample's (1, d) into (d,)). {how}"
    )


def check_loss_value(shape: tuple[int, ...], finite: bool, index: int, options: AnalysisOptions) -> None:
    """Raise the one error every framework gives for an unusable loss value of one batch.

    Args:
        shape: Shape of the value the loss returned (a custom loss must return a scalar).
        finite: Whether the value is finite.
        index: Batch index for the message.
        options: The analysis options (whether the loss is a custom callable).

    Raises:
        TypeError: If a custom loss returned more than one number (a per-sample vector
            would be summed and the measures off by the batch size).
        ValueError: If the loss is NaN or infinite.
    """
    shape = tuple(int(d) for d in shape)
    if callable(options.loss) and int(np.prod(shape, dtype=np.int64)) != 1:
        raise TypeError(
            f"Batch {index}: the loss callable returned an array of shape {shape}; it must return the "
            "mean loss of the batch, a scalar (reduce a per-sample loss with .mean())."
        )
    if not finite:
        raise ValueError(
            f"Batch {index}: the loss is NaN or infinite; check the loss function, the weights and the "
            "inputs."
        )
