"""normflat's own randomness: counter-based, framework-free, independent of the batch split.

The stochastic estimators draw their randomness here, never from a framework's
global generator (the user's random streams are neither consumed nor rewound),
and in a way that depends only on *what* is drawn, not on how the data happens
to be cut into batches or chunks (method §6):

* ``ggn-mc`` draws label ``d`` of the sample at position ``i`` of the data
  stream from the uniform :func:`sample_uniforms` ``(seed, stream, i, d)``, so a
  sample gets the same labels whatever batch or chunk it falls in. ``stream``
  separates the ranks of a distributed run (rank ``r`` uses stream ``r``).
* ``hutchinson`` uses Rademacher probes :func:`rademacher` ``(seed, layer, j)``
  that are drawn once per analysis and reused for every batch: the sum over
  batches of ``v ⊙ H_b v`` is then ``v ⊙ H v`` of the mean loss over all the
  data, whatever the split, and the same on every rank.

Both are pure functions of their arguments (numpy, no state), so every
framework gets bit-identical draws: ``ggn-mc`` and ``hutchinson`` give the same
numbers in torch, Keras and JAX on the same weights and data.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sample_uniforms", "rademacher", "group_of", "group_counts", "rank_seed"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, element-wise on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _key(*words: int) -> np.ndarray:
    """One uint64 key (shape ``(1,)``: array arithmetic wraps without warnings) from ints."""
    key = np.zeros(1, dtype=np.uint64)
    for w in words:
        key = _mix(key ^ (np.asarray([int(w) % 2**64], dtype=np.uint64) + _GOLDEN))
    return key


def sample_uniforms(seed: int, stream: int, start: int, n: int, draws: int) -> np.ndarray:
    """Uniforms in ``[0, 1)`` for ``n`` consecutive samples of the data stream.

    Args:
        seed: The analysis seed.
        stream: Independent stream (the rank of a distributed run, 0 otherwise).
        start: Position of the first sample in this rank's data stream.
        n: Number of samples.
        draws: Draws per sample.

    Returns:
        ``(n, draws)`` float64 array; entry ``[i, d]`` depends only on
        ``(seed, stream, start + i, d)``.
    """
    key = _key(seed, stream, 0x6D63)
    # Hash the sample position and the draw index separately (not i·draws + d), so that
    # draw d of a sample is the same whatever the number of draws.
    position = np.arange(start, start + n, dtype=np.uint64)[:, None]
    draw = np.arange(draws, dtype=np.uint64)[None, :]
    bits = _mix(_mix(key ^ _mix(position + _GOLDEN)) ^ (draw + _GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def rademacher(seed: int, layer: int, probes: range | list[int], shape: tuple[int, ...]) -> np.ndarray:
    """Rademacher probes (±1, int8) of one layer.

    Args:
        seed: The analysis seed.
        layer: Index of the layer in the model's layer order.
        probes: Indices of the probes to draw (probe ``j`` is the same whatever
            chunk it is drawn in).
        shape: Shape of one probe (the layer's weight, in the layout the backend
            chooses; backends draw in the canonical ``(out, in, *kernel)`` layout
            so that every framework uses the same probe for the same entry).

    Returns:
        ``(len(probes), *shape)`` int8 array of ±1.
    """
    numel = int(np.prod(shape, dtype=np.int64))
    out = np.empty((len(probes), numel), dtype=np.int8)
    for row, j in enumerate(probes):
        rng = np.random.Generator(np.random.Philox(key=int(_key(seed, layer, j, 0x68)[0])))
        bits = np.unpackbits(np.frombuffer(rng.bytes((numel + 7) // 8), dtype=np.uint8))[:numel]
        out[row] = 1 - 2 * bits.astype(np.int8)
    return out.reshape(len(probes), *shape)


def group_of(index: int, groups: int) -> int:
    """Group of probe or draw ``index`` among ``groups`` independent group estimates."""
    return index % groups


def group_counts(samples: int, groups: int) -> np.ndarray:
    """Members of each group when ``samples`` probes or draws are dealt round-robin."""
    return np.bincount(np.arange(samples) % groups, minlength=groups).astype(np.int64)


def rank_seed(seed: int, rank: int) -> int:
    """A seed for rank ``rank`` derived from ``seed`` (rank 0 keeps ``seed``).

    Used where a framework needs its own generator seeded per rank; normflat's
    draws themselves separate ranks through the ``stream`` argument.
    """
    if rank == 0:
        return seed
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1
