"""Framework-free stand-ins for a backend: a numpy data adapter, a session, a comm.

They let the engine (``normflat.engine``) be tested without any deep-learning
framework: :class:`NumpyAdapter` is the smallest :class:`DataAdapter`,
:class:`LinearSession` analyzes a linear softmax model ``z = x Wᵀ`` whose GGN
(and, with ``ce``, Hessian) diagonal is known in closed form, and
:class:`ThreadComm` is an in-process :class:`Comm` shared by N threads.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from normflat.engine import INFINITE, LayerSpec
from normflat.engine import data as data_contract
from normflat.engine import losses
from normflat.engine import random as nf_random
from normflat.engine.options import resolve_estimator


class Infinite:
    """A dataset that declares itself infinite (like ``tf.data`` after ``.repeat()``)."""

    def __init__(self, batch):
        self.batch = batch
        self.drawn = 0

    def __iter__(self):
        while True:
            self.drawn += 1
            yield self.batch


class NumpyAdapter:
    """The smallest :class:`normflat.engine.DataAdapter`: numpy arrays, lists, generators."""

    framework = "numpy"

    def is_array(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    def shape(self, a: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in a.shape)

    def kind(self, a: Any) -> str:
        return {"f": "f", "i": "i", "u": "i", "b": "b", "c": "c"}.get(a.dtype.kind, "?")

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def all_finite(self, a: Any) -> bool:
        return bool(np.all(np.isfinite(a)))

    def cardinality(self, data: Any) -> Any:
        if isinstance(data, Infinite):
            return INFINITE
        return len(data) if hasattr(data, "__len__") else None

    def reject(self, data: Any) -> str | None:
        return None

    def iterate(self, data: Any):
        return iter(data)


def nsce_jacobian(z: np.ndarray, temperature: float = 1.0, eps: float = 1e-12) -> np.ndarray:
    """``∂u/∂z`` of one row of logits: ``(τ/σ)(P − ẑẑᵀ/C)`` (method §7), written out."""
    c = z.shape[0]
    zc = z - z.mean()
    sigma = np.sqrt(np.mean(zc**2) + eps)
    zhat = zc / sigma
    return temperature / sigma * (np.eye(c) - np.ones((c, c)) / c - np.outer(zhat, zhat) / c)


def naive_normalize(z: np.ndarray, temperature: float = 1.0, eps: float = 1e-12) -> np.ndarray:
    """The textbook normalization ``τ (z − z̄)/√(mean((z − z̄)²) + ε)`` (method §7)."""
    zc = z - z.mean(axis=-1, keepdims=True)
    return temperature * zc / np.sqrt(np.mean(zc**2, axis=-1, keepdims=True) + eps)


def softmax(u: np.ndarray) -> np.ndarray:
    e = np.exp(u - u.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def logit_hessians(z: np.ndarray, loss: str, temperature: float = 1.0) -> np.ndarray:
    """``(n, C, C)`` GGN blocks ``Jᵀ (diag p − ppᵀ) J`` in the raw logits (J = I for ``ce``)."""
    out = []
    for row in z:
        u = naive_normalize(row, temperature) if loss == "nsce" else row
        p = softmax(u)
        h = np.diag(p) - np.outer(p, p)
        if loss == "nsce":
            j = nsce_jacobian(row, temperature)
            h = j.T @ h @ j
        out.append(h)
    return np.stack(out)


def linear_ggn_diagonal(w: np.ndarray, x: np.ndarray, loss: str, temperature: float = 1.0) -> np.ndarray:
    """GGN diagonal of the mean loss of ``z = x Wᵀ`` w.r.t. ``W``: ``mean_n G_n[c,c] x_nd²``."""
    g = logit_hessians(x @ w.T, loss, temperature)
    return np.einsum("ncc,nd->cd", g, x**2) / len(x)


def linear_full_hessian(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Full Hessian ``(C·D, C·D)`` of the mean ``ce`` loss of ``z = x Wᵀ`` (row-major W)."""
    g = logit_hessians(x @ w.T, "ce")
    c, d = w.shape
    return np.einsum("nab,ni,nj->aibj", g, x, x).reshape(c * d, c * d) / len(x)


class LinearSession:
    """A backend session for ``z = x Wᵀ`` (layer ``fc``) plus a layer the loss never reaches.

    It uses the engine exactly as a real backend must (output checks, labels,
    signals, counter-based draws keyed on ``batch.offset``), so the driver's
    plumbing can be compared with the closed forms above.

    Args:
        w: ``(C, D)`` weight.
        options: The analysis options.
        rank: Stream of the ``ggn-mc`` draws (the rank of a distributed run).
        fail_on: Batch index at which :meth:`update` raises ``ValueError``.
        interrupt_on: Batch index at which :meth:`update` raises ``KeyboardInterrupt``.
    """

    framework = "numpy"
    framework_version = np.__version__

    def __init__(self, w, options, *, rank=0, fail_on=None, interrupt_on=None, signature_extra=None):
        self.w = np.asarray(w, dtype=np.float64)
        self.options = options
        self.rank = rank
        self.fail_on = fail_on
        self.interrupt_on = interrupt_on
        self.signature_extra = signature_extra
        self.adapter = NumpyAdapter()
        self.layers = [
            LayerSpec("fc", "dense", "fc.weight"),
            LayerSpec("unused", "conv2d", "unused.weight", groups=2, path="generic", reason="test"),
        ]
        self.unused_weight = np.arange(1.0, 1.0 + 4 * 3 * 2 * 2).reshape(4, 3, 2, 2)
        self.unsupported = ["odd (Odd: no extractor)"]
        self.closed = 0
        self.updates = []
        self.saturation = math.inf

    def signature(self):
        sig = [("fc", self.w.shape, "float64"), ("unused", self.unused_weight.shape, "float64")]
        return sig + ([self.signature_extra] if self.signature_extra is not None else [])

    def update(self, batch, state):
        self.updates.append(batch.index)
        if batch.index == self.fail_on:
            raise ValueError(f"update failed on batch {batch.index}")
        if batch.index == self.interrupt_on:
            raise KeyboardInterrupt
        x = np.asarray(batch.x, dtype=np.float64)
        z = x @ self.w.T
        c = losses.check_output_shape(z.shape, self.options, batch.index, batch.n)
        self.options = o = resolve_estimator(self.options, c)
        self.saturation = min(self.saturation, losses.check_logit_stats(
            losses.logit_stats(np, z), o, batch.index, c, float(np.finfo(z.dtype).eps)))
        data_contract.labels_for(batch, c, self.adapter, o)  # the GGN needs no labels, the checks do
        if o.estimator == "hutchinson":
            probes = nf_random.rademacher(o.seed, 0, range(o.samples), self.w.shape).astype(np.float64)
            # ce on a linear model: the Hessian is the GGN, Σ_n H_n ⊗ x_n x_nᵀ.
            hz = np.stack([np.diag(p) - np.outer(p, p) for p in softmax(z)])
            contrib = np.zeros((o.groups,) + self.w.shape)
            for j, v in enumerate(probes):
                hv = np.einsum("nab,nd,bd,ne->ae", hz, x, v, x)  # Σ_n H_n (v x_n) x_nᵀ
                contrib[nf_random.group_of(j, o.groups)] += v * hv
        else:
            uniforms = None
            if o.draws:
                uniforms = nf_random.sample_uniforms(o.seed, self.rank, batch.offset, batch.n, o.draws)
            sig = losses.output_signals(np, z, o, uniforms)  # (K, M, n, C)
            contrib = np.einsum("kmnc,nd->kcd", sig**2, x**2)
        state.add(0, contrib)

    def zeros(self, layer):
        shape = self.w.shape if layer == 0 else self.unused_weight.shape
        return np.zeros((self.options.state_groups,) + shape)

    def all_finite(self, array):
        return bool(np.all(np.isfinite(array)))

    def canonical(self, layer, array):
        return array

    def weight(self, layer):
        return self.w.copy() if layer == 0 else self.unused_weight.copy()

    def metadata(self):
        return {"dtype": "float64", "device": "cpu", "chunk_size": 7, "memory_budget": None,
                "backend": {"kernel": "einsum"}, "note": "extra"}

    def close(self):
        self.closed += 1

    def forward_error(self, batch):
        """The plain forward's error on the first rows (inputs of another width than ``w``)."""
        try:
            np.asarray(batch.x, dtype=np.float64)[:2] @ self.w.T
        except Exception as err:  # noqa: BLE001 - returned, as the protocol asks
            return err
        return None


class _Hub:
    """The shared memory of N :class:`ThreadComm`: a barrier-based all-gather."""

    def __init__(self, size: int, timeout: float = 20.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.calls = [0] * size

    def all_gather(self, rank: int, obj: Any) -> list[Any]:
        # Three phases: nobody writes before everyone read the previous round.
        self.barrier.wait()
        self.slots[rank] = obj
        self.calls[rank] += 1
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadComm:
    """An in-process :class:`normflat.engine.Comm` for rank ``rank`` of a :class:`_Hub`."""

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size

    def gather(self, obj):
        return self.hub.all_gather(self.rank, obj)

    def sum_ints(self, values):
        rows = self.gather([int(v) for v in values])
        return [sum(col) for col in zip(*rows)]

    def sum_arrays(self, arrays):
        rows = self.gather(list(arrays))
        out = []
        for i in range(len(arrays)):
            total = rows[0][i]
            for r in range(1, self.size):  # one fixed order: the same result on every rank
                total = total + rows[r][i]
            out.append(total)
        return out


def run_ranks(size: int, fn, timeout: float = 20.0):
    """Run ``fn(comm)`` in ``size`` threads; ``[(result, exception)]`` per rank."""
    hub = _Hub(size, timeout)
    out: list[Any] = [None] * size

    def target(rank):
        try:
            out[rank] = (fn(ThreadComm(hub, rank)), None)
        except BaseException as err:  # noqa: BLE001 - inspected by the test
            out[rank] = (None, err)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3)
        assert not t.is_alive(), "a rank hangs: the protocol lost a collective"
    return out
