"""Benchmark: the spread of ``ggn-topk``'s sampled part against other ways of covering the rest.

``ggn-topk`` (method §6.2) takes the top classes of every sample exactly and samples the
rest: draws ``c ~ p_c / r`` over the classes outside the top ``k``, each the signal
``√r (e_c − p)``. Its error on a layer's normalized sharpness is the spread of that sampled
part. This script measures, per hidden layer, the per-signal spread of the quantity the
error is made of, under that scheme and under signals that mix the rest with random signs
(which a sample-and-square estimator could use as well, each unbiased):

* ``sample``: normflat's draws, ``√r (e_c − p)``, ``c ~ p / r``;
* ``signs``: ``Σ_{c∉T} ε_c √p_c (e_c − p)`` with Rademacher ``ε`` (every class of the rest);
* ``gauss``: the same with standard normal weights;
* ``mix8`` / ``mix32``: ``√(r/m) Σ_j ε_j (e_{c_j} − p)`` over ``m`` drawn classes.

The quantity: at the optimum of method §3 the normalized sharpness of a layer is
``Σ_ij v*_ij A_ij`` and its first-order change ``½ Σ_ij v*_ij δA_ij`` (the envelope
theorem, method §6), so a signal's contribution to a layer's error is its ``v*``-weighted
squared per-sample gradient ``Σ_ij v*_ij Σ_k (J_nᵀ s)²_ijk``, with ``v*`` from the exact
``ggn``. For each image the script back-propagates ``--signals`` signals of every scheme
(one image at a time, so that the parameter gradient is the per-sample one) and prints,
per scheme, the layers' relative standard deviation of the normalized sharpness that
``--per-image`` signals per image would give (normflat's default: 10 draws), median and
largest over the layers, with the ratio of each scheme's mean to the sampled one's (all
are unbiased: near 1).

Run::

    python -m benchmarks.topk_rest [--problem resnet18-1000] [--signals 24] [--per-image 10]

(the exact ``ggn`` of resnet18 with 1000 classes takes a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import normflat
from benchmarks.classes import PROBLEMS, make_problem

SCHEMES = ("sample", "signs", "gauss", "mix8", "mix32")


def _optimal_variances(model: torch.nn.Module, data, classes: int) -> dict[str, torch.Tensor]:
    """``v*_ij = σ_i σ'_j`` of every hidden weight layer from the exact ``ggn`` (0 where a row or
    column is degenerate: its curvature, and every signal's square there, is 0)."""
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    out = {}
    for layer in report.layers:
        if layer.shape[0] == classes:  # the dense head: exact under ggn-topk
            continue
        v = np.outer(layer.row_sigma, layer.col_sigma)
        out[layer.name] = torch.tensor(np.where(np.isfinite(v), v, 0.0), dtype=torch.float32)
    return out


def _signal(scheme: str, p: torch.Tensor, rest: torch.Tensor, q: np.ndarray, r: float,
            rng: np.random.Generator) -> torch.Tensor:
    """One signal of ``scheme`` at the logits of one sample (``rest``: 1 outside the top classes)."""
    c = p.shape[0]
    if scheme == "sample":
        w = torch.zeros(c)
        w[rng.choice(c, p=q)] = math.sqrt(r)
    elif scheme in ("signs", "gauss"):
        draw = rng.choice([-1.0, 1.0], size=c) if scheme == "signs" else rng.standard_normal(c)
        w = torch.tensor(draw, dtype=torch.float32) * rest * p.sqrt()
    else:
        m = int(scheme[3:])
        w = torch.zeros(c)
        for cls, sign in zip(rng.choice(c, p=q, size=m), rng.choice([-1.0, 1.0], size=m)):
            w[cls] += sign
        w = w * math.sqrt(r / m)
    return w - p * w.sum()  # Σ_c w_c (e_c − p)


def measure(name: str, signals: int, per_image: int, top: int = 2, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """``{scheme: (median, largest relative SD of the layers' normalized sharpness, mean ratio)}``."""
    model, (x, y), _ = make_problem(name)
    classes = PROBLEMS[name][1]
    weights = _optimal_variances(model, (x, y), classes)
    modules = dict(model.named_modules())
    params = [modules[layer].weight for layer in weights]
    variances = list(weights.values())
    rng = np.random.default_rng(seed)

    def functional(z: torch.Tensor, s: torch.Tensor) -> np.ndarray:
        grads = torch.autograd.grad(z, params, s, retain_graph=True)
        out = []
        for g, v in zip(grads, variances):
            sq = g.square()
            if sq.dim() > 2:
                sq = sq.sum(dim=tuple(range(2, sq.dim())))  # kernel sums (method §3)
            out.append(float((sq * v).sum()))
        return np.array(out)

    exact_top = np.zeros(len(params))
    draws = {scheme: [] for scheme in SCHEMES}
    for n in range(x.shape[0]):
        z = model(x[n:n + 1])[0]
        p = torch.softmax(z.detach().double(), -1).float()
        rest = torch.ones(classes)
        top_classes = torch.argsort(p, descending=True)[:top]
        rest[top_classes] = 0.0
        r = float((p * rest).sum())
        q = (p * rest).double().numpy()
        q /= q.sum()
        for cls in top_classes:
            exact_top += float(p[cls]) * functional(z, torch.eye(classes)[cls] - p)
        for scheme in SCHEMES:
            draws[scheme].append(np.array([functional(z, _signal(scheme, p, rest, q, r, rng)) for _ in range(signals)]))
    result = {}
    reference = exact_top + sum(d.mean(axis=0) for d in draws["sample"])
    for scheme in SCHEMES:
        per = np.array(draws[scheme])  # (images, signals, layers)
        total = exact_top + per.mean(axis=1).sum(axis=0)
        variance = per.var(axis=1, ddof=1).sum(axis=0) / per_image  # of the sum over the images
        rel_sd = 0.5 * np.sqrt(variance) / total  # NS = Σ v* A, dNS = ½ Σ v* dA
        result[scheme] = (float(np.median(rel_sd)), float(rel_sd.max()), float(np.median(total / reference)))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="resnet18-1000", choices=[p for p in PROBLEMS if p != "gpt2-5000"])
    parser.add_argument("--signals", type=int, default=24, help="signals of every scheme per image")
    parser.add_argument("--per-image", type=int, default=10, help="signals per image of the reported spread")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = measure(args.problem, args.signals, args.per_image)
    print(f"{args.problem}: relative SD of each hidden layer's normalized sharpness with {args.per_image} "
          f"signals per image ({time.perf_counter() - start:.0f} s)")
    print("| scheme | median over layers | largest | mean / sampled mean |")
    print("|---|---|---|---|")
    for scheme, (median, largest, ratio) in result.items():
        print(f"| {scheme} | {median:.2%} | {largest:.2%} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
