"""A numpy ReLU MLP implementing the engine's PerturbationModel (method §10), with
hand-written exact gradients: the reference the engine's rival measures are tested on."""

from __future__ import annotations

import numpy as np

from normflat.engine.options import AnalysisOptions
from normflat.engine.perturbation import prediction_losses


class NumpyMLP:
    """``x -> W2 relu(W1 x + b1) + b2`` (one hidden layer) or ``x -> W1 x + b1`` (linear)."""

    def __init__(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, loss: str = "ce") -> None:
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
        self.layers = [k for k in ("W1", "W2") if k in self.params]
        self.names = list(self.layers)
        self.kinds = ["dense"] * len(self.layers)
        self.x, self.y = np.asarray(x, dtype=np.float64), np.asarray(y)
        self.options = AnalysisOptions(loss=loss)
        self.calls = 0

    def weights(self) -> list[np.ndarray]:
        return [self.params[k].copy() for k in self.layers]

    def _forward(self, deltas):
        p = dict(self.params)
        for k, d in zip(self.layers, deltas or [0.0] * len(self.layers)):
            p[k] = p[k] + d
        h = self.x @ p["W1"].T + p["b1"]
        if "W2" not in p:
            return p, h, None
        a = np.maximum(h, 0.0)
        return p, a @ p["W2"].T + p["b2"], (h, a)

    def evaluate(self, deltas):
        self.calls += 1
        _, z, _ = self._forward(deltas)
        losses, correct, counted = prediction_losses(np, z, self.y, self.options)
        return np.asarray(losses[counted], dtype=np.float64), np.asarray(correct[counted], dtype=bool)

    def _logit_grad(self, z):
        assert self.options.loss == "ce"
        e = np.exp(z - z.max(1, keepdims=True))
        p = e / e.sum(1, keepdims=True)
        p[np.arange(len(self.y)), self.y] -= 1.0
        return p  # d loss_i / d z_i

    def per_sample_grads(self, deltas=None):
        p, z, hidden = self._forward(deltas)
        gz = self._logit_grad(z)
        if hidden is None:
            return [np.einsum("nc,nd->ncd", gz, self.x)]
        h, a = hidden
        g2 = np.einsum("nc,nh->nch", gz, a)
        gh = (gz @ p["W2"]) * (h > 0)
        g1 = np.einsum("nh,nd->nhd", gh, self.x)
        return [g1, g2]

    def gradient(self, deltas):
        self.calls += 1
        losses, _ = self.evaluate(deltas)
        self.calls -= 1
        return float(np.mean(losses)), [g.mean(0) for g in self.per_sample_grads(deltas)]

    def weight_derivatives(self):
        grads = self.per_sample_grads()
        return sum((g * self.params[k][None]).reshape(len(g), -1).sum(1) for g, k in zip(grads, self.layers))

    def squared_output(self):
        sq = {k: v * v for k, v in self.params.items()}
        h = sq["W1"] @ np.ones(self.x.shape[1]) + sq["b1"]
        if "W2" not in sq:
            return float(h.sum())
        return float((sq["W2"] @ h + sq["b2"]).sum())

    def close(self):
        pass


def random_mlp(seed: int = 0, n: int = 12, d: int = 3, hidden: int = 4, classes: int = 3, linear: bool = False):
    rng = np.random.default_rng(seed)
    params = {"W1": rng.normal(size=(classes if linear else hidden, d)), "b1": rng.normal(size=classes if linear else hidden) * 0.1}
    if not linear:
        params["W2"] = rng.normal(size=(classes, hidden))
        params["b2"] = rng.normal(size=classes) * 0.1
    x = rng.normal(size=(n, d))
    y = rng.integers(0, classes, size=n)
    return params, x, y


def rescaled(params: dict[str, np.ndarray], seed: int = 5, orders: float = 2.0) -> dict[str, np.ndarray]:
    """Unit-wise ReLU rescaling: hidden unit k's row and bias times c_k, its column / c_k."""
    c = 10.0 ** np.random.default_rng(seed).uniform(-orders, orders, size=params["W1"].shape[0])
    return {"W1": params["W1"] * c[:, None], "b1": params["b1"] * c, "W2": params["W2"] / c[None, :],
            "b2": params["b2"].copy()}
