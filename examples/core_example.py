"""Normalized sharpness from layer problems, without any framework.

Shows the framework-free path: weights and Hessian diagonals in the canonical
``(out, in, *kernel)`` layout go into ``normflat.analyze``. It also shows the
point of the measure: rescaling rows and columns of a weight matrix (which a
ReLU network allows without changing its function) moves the Hessian trace by
orders of magnitude but leaves the normalized sharpness where it was.

Run: ``bash scripts/main`` (or ``.venv/bin/python examples/core_example.py``).
"""

import numpy as np

import normflat

rng = np.random.default_rng(0)
dense_w = rng.normal(size=(10, 64)) / 8
dense_h = rng.random((10, 64)) * 1e-2
conv_w = rng.normal(size=(16, 8, 3, 3)) / 8
conv_h = rng.normal(size=(16, 8, 3, 3)) * 1e-3 + 2e-3

problems = [
    normflat.LayerProblem("features.0", conv_w, conv_h, kind="conv2d"),
    normflat.LayerProblem("classifier", dense_w, dense_h, kind="dense"),
]
report = normflat.analyze(problems)
print(report)

# A function-preserving reparametrization: scale every output channel of the conv
# by c_k and the Hessian diagonal by 1/c_k² (what a following BatchNorm or a
# unit-wise ReLU rescaling does to the loss landscape).
c = np.exp(rng.uniform(-4, 4, size=16)).reshape(16, 1, 1, 1)
rescaled = [
    normflat.LayerProblem("features.0", conv_w * c, conv_h / c**2, kind="conv2d"),
    problems[1],
]
after = normflat.analyze(rescaled)
print()
print(f"{'measure':30s} {'before':>12s} {'after rescaling':>16s}")
for measure in normflat.MEASURES:
    print(f"{measure:30s} {getattr(report, measure):12.6g} {getattr(after, measure):16.6g}")
