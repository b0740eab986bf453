"""The ``exact`` and ``hutchinson`` kernels: Hessian-vector products by nested ``GradientTape``s (method §6).

Both differentiate the **sum** of the loss over one chunk of samples (a
custom loss returns the chunk's mean, multiplied by its size here), so the
engine's division by the number of samples gives the Hessian of the mean loss
whatever the batch and chunk split.

* ``exact``: one-hot probes of one layer at a time; the sums are ``(1, *shape)``.
* ``hutchinson``: Rademacher probes of :func:`normflat.engine.random.rademacher`,
  drawn in the canonical ``(out, in/groups, *k)`` layout (the same probe for the
  same weight entry in every framework) and moved to the variable's layout; the
  same probes for every batch and rank. Probe ``j`` adds ``v_j ⊙ H v_j`` to
  group ``j mod K``; the engine divides by the probes per group.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.backends.keras.ggn import compute_dtype, model_logits
from normflat.backends.keras.layers import Entry, convolution_classes, loops_through_time
from normflat.backends.keras.ops import TF
from normflat.engine.losses import check_loss_value, logit_stats, loss_sum
from normflat.engine.options import AnalysisOptions
from normflat.engine.random import rademacher

__all__ = ["hvp_step_fns", "native_positions", "native_probes", "probes_in_sequence", "EXACT_BLOCK", "PROBE_BLOCK"]

#: Probe entries per exact step, over all analyzed weights (bounds the vectorized HVPs' memory).
EXACT_BLOCK = 2**22
#: Probe entries per Hutchinson step, over all analyzed weights.
PROBE_BLOCK = 2**24


def _loss_sum(z: Any, target: Any, options: AnalysisOptions, holder: dict) -> Any:
    if callable(options.loss):
        value = tf.convert_to_tensor(options.loss(z, target))
        if value.shape.is_fully_defined():  # checked while tracing: a per-sample vector is refused
            check_loss_value(tuple(value.shape), True, holder.get("index", 0), options)
        value = tf.reshape(value, [])
        return value * tf.cast(tf.shape(z)[0], value.dtype)
    zc = tf.cast(z, compute_dtype(z.dtype))
    return loss_sum(TF, zc, target, options)


def has_recurrence(model: Any) -> bool:
    """Whether the model runs a recurrent layer (a ``tf.while_loop`` through time, :func:`loops_through_time`)."""
    return any(loops_through_time(layer) for layer in compat.flatten_layers(model))


def probes_in_sequence(model: Any) -> bool:
    """Whether the Hessian-vector products of ``hutchinson``'s probes run one after the other
    (``tf.map_fn``, :func:`hvp_step_fns`' ``probes_sequential``) rather than vectorized
    (``tf.vectorized_map``): for a model with a recurrent layer (TensorFlow's vectorization cannot
    convert the second derivative of a ``tf.while_loop``) or a convolution layer.

    TensorFlow's vectorization has no rule for a convolution's second derivative either
    (``Conv2DBackpropFilter`` and its kin): it falls back to a loop over the probes per operation,
    and the functions of those loops stay in TensorFlow's context after the step is freed, 7.2 MiB
    per ``hutchinson`` analysis of a new small CNN (``benchmarks/keras_retained.py``). One after
    the other, the same CNN's step ran as fast (0.186 s against 0.188 s for 8 probes, one thread,
    2026-12-07), its first call faster (0.82 s against 1.27 s), with nothing left behind; an MLP
    keeps the vectorized products
    (0.297 s against 0.316 s one after the other, 16 probes of 784-512-256-10). ``exact`` keeps them
    vectorized on a tiny CNN (0.16 s against 0.35 s), one after the other for recurrent layers only.
    """
    convolutions = convolution_classes()
    return has_recurrence(model) or any(isinstance(layer, convolutions) for layer in compat.flatten_layers(model))


def hvp_step_fns(model: Any, entries: list[Entry], options: AnalysisOptions, groups: int,
                 holder: dict, sequential: bool = False,
                 probes_sequential: bool | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Compiled ``exact_step(x, target, indices)`` and ``hutchinson_step(x, target, probes, seg)``.

    ``exact_step`` returns the Hessian diagonal entries ``indices`` of the analyzed
    variables flattened and concatenated in order (variable layout): one trace for every
    layer and block, where a trace per layer cost seconds each; ``hutchinson_step`` the per-layer
    ``(K, *variable shape)`` sums of ``v ⊙ H v``; both also the loss sum and the
    :func:`~normflat.engine.losses.logit_stats` of the chunk.

    ``sequential``: the Hessian-vector products run one after the other (``tf.map_fn``)
    instead of vectorized: TensorFlow's vectorization cannot convert the second derivative
    of a ``tf.while_loop`` (recurrent layers). ``probes_sequential``: the same for
    ``hutchinson_step``'s probes only (:func:`probes_in_sequence`; ``None``: ``sequential``).
    ``exact_step``'s one-hot probes of a tiny convolutional model stay vectorized, twice as
    fast there. The result is the same either way.
    """
    if probes_sequential is None:
        probes_sequential = sequential
    variables = [e.variable.value for e in entries]
    sizes = [int(np.prod(v.shape)) for v in variables]
    model_ref = weakref.ref(model)

    def grads_and_hvp(x, target, probes, layer, in_sequence):
        with tf.GradientTape(persistent=True) as outer:
            for v in variables:
                outer.watch(v)
            with tf.GradientTape() as inner:
                for v in variables:
                    inner.watch(v)
                z = model_logits(model_ref(), x, options, holder.get("logits"))
                loss = _loss_sum(z, target, options, holder)
            g = inner.gradient(loss, variables)
            # Embedding gradients are IndexedSlices: dense, to be differentiated again.
            g = [tf.zeros_like(v) if gi is None else tf.convert_to_tensor(gi) for gi, v in zip(g, variables)]
        if layer is not None:
            sources, targets_ = [variables[layer]], [g[layer]]
        else:
            sources, targets_ = variables, g

        def hvp(vs):
            out = outer.gradient(targets_, sources, output_gradients=vs)
            return [tf.zeros_like(s) if o is None else tf.convert_to_tensor(o) for o, s in zip(out, sources)]

        zs = tf.reshape(tf.stop_gradient(z), [-1, int(z.shape[-1])])  # token logits: one row per token
        stats = logit_stats(TF, tf.cast(zs, compute_dtype(z.dtype)))
        if in_sequence:
            signature = [tf.TensorSpec(s.shape, s.dtype) for s in sources]
            return tf.map_fn(hvp, probes, fn_output_signature=signature), loss, stats
        return tf.vectorized_map(hvp, probes), loss, stats

    @tf.function(reduce_retracing=True, autograph=False)
    def exact_step(x, target, indices):
        # One-hot probes over all variables at once: e_i H e_i needs H e_i only on the variable
        # holding entry i, but one trace for all is cheaper than a trace per variable.
        flat = tf.one_hot(indices, sum(sizes), dtype=tf.float64)
        probes = [tf.reshape(tf.cast(p, v.dtype), [-1, *v.shape])
                  for p, v in zip(tf.split(flat, sizes, axis=1), variables)]
        hv, loss, stats = grads_and_hvp(x, target, probes, None, sequential)
        m = tf.shape(indices)[0]
        diag = tf.add_n([tf.reduce_sum(tf.reshape(tf.cast(h * p, tf.float64), [m, -1]), axis=1)
                         for h, p in zip(hv, probes)])
        return diag, loss, stats

    @tf.function(reduce_retracing=True, autograph=False)
    def hutchinson_step(x, target, probes, seg):
        hv, loss, stats = grads_and_hvp(x, target, probes, None, probes_sequential)
        return [tf.math.unsorted_segment_sum(p * h, seg, groups) for p, h in zip(probes, hv)], loss, stats

    return exact_step, hutchinson_step


def native_positions(entry: Entry) -> tuple[np.ndarray, tuple[int, ...]]:
    """Where each canonical entry lives in the variable: ``(flat native index per canonical entry, canonical shape)``.

    ``to_canonical`` only moves entries, so applying it to the entries' own
    indices gives the permutation (also for registered layers' converters).
    """
    shape = tuple(int(d) for d in entry.variable.shape)
    numel = int(np.prod(shape, dtype=np.int64))
    index = tf.reshape(tf.range(numel, dtype=tf.float64), shape)
    canon = np.asarray(entry.weight.to_canonical(index).numpy())
    return canon.reshape(-1).astype(np.int64), tuple(int(d) for d in canon.shape)


def native_probes(seed: int, layer: int, probes: range, positions: np.ndarray, canonical_shape: tuple[int, ...],
                  shape: tuple[int, ...]) -> np.ndarray:
    """Rademacher probes ``(m, *variable shape)`` (int8): the engine's canonical probes in the variable layout."""
    canon = rademacher(seed, layer, probes, canonical_shape).reshape(len(probes), -1)
    out = np.empty_like(canon)
    out[:, positions] = canon
    return out.reshape(len(probes), *shape)
