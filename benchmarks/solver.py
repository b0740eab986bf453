"""Speed of the per-layer solver (issue: foundation, item 7).

Prints:
1. the wall time of ``normflat.analyze`` on a ResNet-50-shaped set of layers
   (about 25.5M weights; shapes below) with synthetic weights and Hessian
   diagonals of realistic structure (row/column scale factors times noise);
2. on one 512x512 layer, normflat's solver against (a) plain gradient descent on
   the log-variances, as the paper did, and (b) scipy's L-BFGS, as ratios.

Run: ``.venv/bin/python benchmarks/solver.py``
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import numpy as np
from scipy.optimize import minimize

import normflat
from normflat.core.measures import curvature_and_weight_matrices
from normflat.core.solver import solve_scaling


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Canonical (out, in, kh, kw) shapes of torchvision's ResNet-50 weights."""
    shapes = [("conv1", (64, 3, 7, 7))]
    in_ch = 64
    for stage, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        out_ch = width * 4
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            shapes += [
                (f"{prefix}.conv1", (width, in_ch, 1, 1)),
                (f"{prefix}.conv2", (width, width, 3, 3)),
                (f"{prefix}.conv3", (out_ch, width, 1, 1)),
            ]
            if block == 0:
                shapes.append((f"{prefix}.downsample.0", (out_ch, in_ch, 1, 1)))
            in_ch = out_ch
    shapes.append(("fc", (1000, 2048)))
    return shapes


def synthetic_layer(rng, shape):
    """Weights ~ N(0, 2/fan_in); Hessian diagonal = row x column scales x noise.

    Real Hessian diagonals are sums over samples of squared signals times squared
    inputs, hence roughly low-rank with heavy-tailed scales; a small fraction of
    entries is negative (Hessian, not GGN).
    """
    out, inp = shape[:2]
    fan_in = inp * int(np.prod(shape[2:], dtype=int))
    W = rng.normal(size=shape) * math.sqrt(2.0 / fan_in)
    row = np.exp(rng.normal(size=(out,) + (1,) * (len(shape) - 1)) * 1.5)
    col = np.exp(rng.normal(size=(1, inp) + (1,) * (len(shape) - 2)) * 1.5)
    noise = np.exp(rng.normal(size=shape) * 0.7)
    H = 1e-3 * row * col * noise * np.where(rng.random(shape) < 0.02, -0.5, 1.0)
    return W, H


def objective(A, B, x):
    m = A.shape[0]
    s = x[:m, None] + x[None, m:]
    P, Q = A * np.exp(s), B * np.exp(-s)
    val = 0.5 * (P.sum() + Q.sum())
    D = 0.5 * (P - Q)
    return val, np.concatenate([D.sum(axis=1), D.sum(axis=0)])


def gradient_descent(A, B, target, *, steps, lr):
    """The paper's approach: plain gradient descent on the log-variances."""
    m, n = A.shape
    x = np.zeros(m + n)
    scale = math.sqrt(A.sum() * B.sum())
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        val, grad = objective(A, B, x)
        if (val - target) / target <= 1e-8:
            return step, time.perf_counter() - t0, (val - target) / target
        x -= lr * grad / scale
    val, _ = objective(A, B, x)
    return steps, time.perf_counter() - t0, (val - target) / target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gd-steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"machine: {platform.processor() or platform.machine()}, numpy {np.__version__}")

    shapes = resnet50_shapes()
    problems = [normflat.LayerProblem(name, *synthetic_layer(rng, shape), kind="conv2d" if len(shape) == 4 else "dense")
                for name, shape in shapes]
    n_weights = sum(int(np.prod(s)) for _, s in shapes)
    times, solve_times = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        report = normflat.analyze(problems)
        times.append(time.perf_counter() - t0)
        mats = [curvature_and_weight_matrices(p.weight, p.hessian_diag)[:2] for p in problems]
        t0 = time.perf_counter()
        for A, B in mats:
            solve_scaling(A, B)
        solve_times.append(time.perf_counter() - t0)
    iters = [layer.iterations for layer in report.layers]
    print(f"\nResNet-50-shaped set: {len(shapes)} layers, {n_weights / 1e6:.1f}M weights")
    print(f"  analyze (all four measures, incl. kernel sums): {min(times):.3f} s (best of {args.repeats})")
    print(f"  solver only:                                     {min(solve_times):.3f} s")
    print(f"  solver sweeps per layer: median {int(np.median(iters))}, max {max(iters)}; "
          f"all converged: {all(layer.converged for layer in report.layers)}")

    W, H = synthetic_layer(rng, (512, 512))
    A = np.maximum(H, 0.0)
    B = W**2
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        sol = solve_scaling(A, B)
    t_ours = (time.perf_counter() - t0) / args.repeats
    # High-accuracy reference value for the relative errors below.
    reference = solve_scaling(A, B, tol=1e-14, max_iter=100_000).value
    err_ours = (sol.value - reference) / reference
    print(f"\nOne 512x512 layer: normflat {t_ours * 1e3:.2f} ms, {sol.iterations} sweeps, rel. error {err_ours:.1e}")

    best = None
    for lr in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0):  # best fixed step size, as a tuned baseline would use
        steps, t_gd, err_gd = gradient_descent(A, B, reference, steps=args.gd_steps, lr=lr)
        if not math.isfinite(err_gd):
            continue
        if best is None or (err_gd, t_gd) < (best[2], best[1]):
            best = (steps, t_gd, err_gd, lr)
    steps, t_gd, err_gd, lr = best
    reached = err_gd <= 1e-8
    print(f"  gradient descent (lr={lr}): {steps} steps, {t_gd:.2f} s, rel. error {err_gd:.1e}"
          + ("" if reached else f" (did not reach 1e-8 in {args.gd_steps} steps)"))
    print(f"  speed-up over gradient descent: {'' if reached else '>= '}{t_gd / t_ours:,.0f}x")

    m = A.shape[0]
    scale = math.sqrt(A.sum() * B.sum())
    t0 = time.perf_counter()
    res = minimize(lambda x: tuple(v / scale for v in objective(A, B, x)), np.zeros(m + A.shape[1]),
                   jac=True, method="L-BFGS-B", options={"maxiter": 100_000, "ftol": 1e-16, "gtol": 1e-12})
    t_lbfgs = time.perf_counter() - t0
    err_lbfgs = (res.fun * scale - reference) / reference
    print(f"  scipy L-BFGS: {res.nit} iterations, {t_lbfgs:.2f} s, rel. error {err_lbfgs:.1e}")
    print(f"  speed-up over L-BFGS: {t_lbfgs / t_ours:,.0f}x")


if __name__ == "__main__":
    main()
