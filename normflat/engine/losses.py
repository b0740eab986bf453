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
* for ``nsce`` the signals are pulled back through the normalization, whose
  Jacobian ``(τ/σ)(P − ẑ ẑᵀ / C)`` is symmetric (:func:`pull_back`);
* token logits ``(n, T, C)`` (method §6.3): every counted token is one term of
  the mean loss; labels equal to ``ignore_index`` are masked out, and the GGN
  signals of token ``t`` are placed at token ``t`` only (:func:`token_signals`),
  so that every (token, signal) pair is its own squared per-sample gradient.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from normflat.engine.options import NSCE_EPS, AnalysisOptions

__all__ = [
    "normalize_logits",
    "log_softmax",
    "loss_sum",
    "one_hot",
    "ggn_factor",
    "mc_signals",
    "pull_back",
    "output_signals",
    "token_signals",
    "logit_stats",
    "check_logit_stats",
    "CONSTANT_LOGITS_RMS",
    "check_output_shape",
    "check_loss_value",
    "namespace_check",
]

#: ``nsce`` refuses rows whose centred logits have an RMS below this: there the ε of
#: the normalization changes the normalized logits by more than 5e-5 relatively and the
#: curvature is of order 1/ε (a zero-initialized head gives a Hessian trace of ~1e13).
CONSTANT_LOGITS_RMS = math.sqrt(1e4 * NSCE_EPS)


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
    last = xp.astype(_arange_like(xp, c, p) == c - 1, p.dtype)
    v = u + last[None, :]
    sv = u * v - p * xp.sum(u * v, axis=-1, keepdims=True)
    scale = 2 / xp.sum(v * v, axis=-1)
    SR = S - scale[:, None, None] * sv[:, :, None] * v[:, None, :]
    return _permute(xp, SR[:, :, : c - 1], (2, 0, 1))


def _cumsum(xp: Any, x: Any) -> Any:
    fn = getattr(xp, "cumulative_sum", None) or xp.cumsum
    return fn(x, axis=-1)


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
    c = int(p.shape[1])  # the sample axis may be unknown while tracing (tf.function, relaxed shapes)
    draws = int(uniforms.shape[1])
    cum = _cumsum(xp, p)  # (n, C)
    # The class of a draw: how many cumulative probabilities lie below the uniform
    # (clipped: rounding can leave the last cumulative sum just below 1).
    below = xp.astype(cum[:, None, : c - 1] <= uniforms[:, :, None], p.dtype)  # (n, S, C-1)
    index = xp.sum(below, axis=-1)  # (n, S) float class index
    classes = xp.astype(_arange_like(xp, c, p), p.dtype)
    e = xp.astype(index[:, :, None] == classes[None, None, :], p.dtype) - p[:, None, :]  # (n, S, C)
    members = -(-draws // groups)
    if members * groups > draws:  # pad to whole rounds; the padding rows are zero signals
        e = xp.concat([e, xp.zeros_like(e[:, : members * groups - draws, :])], axis=1)
    # Draw d = m·K + k sits at (m, k): one reshape deals the draws round-robin into groups,
    # vectorized (a loop over draws would build thousands of ops in compiled code).
    e = _permute(xp, xp.reshape(e, (-1, members, groups, c)), (2, 1, 0, 3))  # (K, M, n, C)
    counts = [len(range(k, draws, groups)) for k in range(groups)]
    return xp.stack([e[k] * (1.0 / math.sqrt(counts[k])) for k in range(groups)])


def pull_back(xp: Any, signals: Any, zhat: Any, sigma: Any, temperature: float) -> Any:
    """Signals in the normalized logits pulled back to the raw logits (``nsce``).

    The normalization's Jacobian ``(τ/σ)(P − ẑ ẑᵀ/C)`` (``P`` the centring
    projection) is symmetric, so ``Jᵀ s = (τ/σ)(s − s̄ − ẑ (ẑ·s)/C)``.
    """
    c = int(signals.shape[-1])
    centred = signals - xp.mean(signals, axis=-1, keepdims=True)
    proj = xp.sum(signals * zhat, axis=-1, keepdims=True) / c
    return (temperature / sigma) * (centred - zhat * proj)


def output_signals(xp: Any, logits: Any, options: AnalysisOptions, uniforms: Any = None) -> Any:
    """GGN signals ``(K, M, n, C)`` at the raw logits of one chunk.

    ``Σ_{m} s_{k,m,i} s_{k,m,i}ᵀ`` is, for each sample ``i`` and group ``k``, the
    loss Hessian in the logits (``ggn``: exactly, ``K = 1``, ``M = C − 1``) or an
    unbiased estimate of it (``ggn-mc``: ``uniforms`` of shape ``(n, samples)``).
    """
    if options.loss == "nsce":
        u, zhat, sigma = normalize_logits(xp, logits, options.temperature)
    else:
        u = logits
    p = _softmax(xp, u)
    if options.estimator == "ggn":
        sig = ggn_factor(xp, p)[None]
    else:
        if uniforms is None:
            raise ValueError("ggn-mc needs the uniforms of normflat.engine.random.sample_uniforms.")
        sig = mc_signals(xp, p, uniforms, options.groups)
    if options.loss == "nsce":
        sig = pull_back(xp, sig, zhat, sigma, options.temperature)
    return sig


def token_signals(xp: Any, logits: Any, options: AnalysisOptions, counted: Any, uniforms: Any = None,
                  tokens: tuple[int, int] | None = None) -> Any:
    """GGN signals ``(K, M·W, n, T, C)`` of token logits ``(n, T, C)`` (method §6.3).

    The loss Hessian of one sequence is block-diagonal over its tokens, so its
    factor is the per-token factor of :func:`output_signals` placed at one token:
    signal ``m·W + j`` is the ``m``-th signal of token ``lo + j`` at position ``lo + j``
    and zero elsewhere. Tokens not counted (``counted`` is 0) carry zero signals.

    Args:
        xp: Array namespace.
        logits: ``(n, T, C)`` token logits.
        options: The analysis options.
        counted: ``(n, T)`` 1 for counted tokens, 0 for ignored ones (logits' dtype).
        uniforms: ``ggn-mc`` only: ``(n, T·S)`` uniforms, token ``t`` taking columns
            ``t·S .. (t+1)·S − 1``.
        tokens: ``(lo, hi)``: only the signals of tokens ``lo .. hi − 1`` (``W = hi − lo``),
            so that a backend can bound memory by taking a few tokens at a time;
            ``None``: every token (``W = T``). Each token's signals depend on its own
            logits and uniforms only, so the blocks together are the whole factor.
    """
    n, t, c = (int(d) for d in logits.shape)
    lo, hi = tokens if tokens is not None else (0, t)
    w = hi - lo
    rows = xp.reshape(logits[:, lo:hi], (n * w, c))
    if uniforms is not None:
        draws = int(uniforms.shape[1]) // t
        uniforms = xp.reshape(uniforms[:, lo * draws:hi * draws], (n * w, draws))
    sig = output_signals(xp, rows, options, uniforms)  # (K, M, n·W, C)
    k, m = int(sig.shape[0]), int(sig.shape[1])
    sig = xp.reshape(sig, (k, m, n, w, c)) * counted[None, None, :, lo:hi, None]
    sig = _permute(xp, sig, (0, 1, 3, 2, 4))  # (K, M, W, n, C)
    place = xp.astype(_arange_like(xp, w, logits)[:, None] + lo == _arange_like(xp, t, logits)[None, :],
                      logits.dtype)  # (W, T): token lo + j sits at position lo + j
    placed = sig[:, :, :, :, None, :] * place[None, None, :, None, :, None]  # (K, M, W, n, T, C)
    return xp.reshape(placed, (k, m * w, n, t, c))


def logit_stats(xp: Any, logits: Any) -> Any:
    """Five numbers summarizing ``(n, C)`` logits for :func:`check_logit_stats`.

    Computable inside compiled code (one small array, checked on the host later):
    ``[all finite, min entry, max |row sum − 1|, min row RMS of the centred logits,
    max |entry|]``.
    """
    finite = xp.astype(xp.all(xp.isfinite(logits)), logits.dtype)
    safe = xp.where(xp.isfinite(logits), logits, xp.zeros_like(logits))
    zc = safe - xp.mean(safe, axis=-1, keepdims=True)
    m = xp.max(xp.abs(zc), axis=-1, keepdims=True)
    m1 = xp.where(m > 0, m, xp.ones_like(m))
    rms = m1 * xp.sqrt(xp.mean((zc / m1) ** 2, axis=-1, keepdims=True))
    rms = xp.where(m > 0, rms, xp.zeros_like(rms))
    return xp.stack([
        finite,
        xp.min(safe),
        xp.max(xp.abs(xp.sum(safe, axis=-1) - 1)),
        xp.min(rms),
        xp.max(xp.abs(safe)),
    ])


def check_logit_stats(stats: Any, options: AnalysisOptions, index: int, num_classes: int,
                      dtype_eps: float) -> None:
    """Raise the one error every framework gives for unusable logits.

    Args:
        stats: :func:`logit_stats` of a batch (any array type; read on the host).
        options: The analysis options.
        index: Batch index for the message.
        num_classes: ``C``.
        dtype_eps: Machine epsilon of the logits' dtype (``numpy.finfo(dtype).eps``).

    Raises:
        ValueError: For NaN/inf logits; for probabilities given as logits (built-in
            losses); for constant logits with ``nsce``.
    """
    finite, lo, row_dev, min_rms, max_abs = (float(v) for v in np.asarray(stats, dtype=np.float64))
    if not finite:
        raise ValueError(
            f"Batch {index}: the model's logits contain NaN or infinite values; check the weights "
            "(a diverged training run?) and the inputs."
        )
    if callable(options.loss):
        return
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


def check_output_shape(shape: tuple[int, ...], options: AnalysisOptions, index: int, n: int) -> int:
    """Check the model's output shape ``(n, C)`` or ``(n, T, C)`` (token logits); return ``C``.

    Raises:
        ValueError: For outputs that are neither ``(batch, classes)`` nor
            ``(batch, tokens, classes)`` logits, and for a single output unit with a
            built-in loss.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"Batch {index}: the model's output has shape {shape}; normflat needs logits of shape "
            "(batch, classes), or token logits (batch, tokens, classes) with token labels (batch, tokens). "
            "Flatten or pool extra axes in the model, or wrap it."
        )
    if shape[0] != n:
        raise ValueError(f"Batch {index}: the model returned {shape[0]} rows of logits for {n} samples.")
    c = shape[-1]
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
